"""Pieces shared by every service: config loading, errors, logging, storage URLs."""
