"""Protocol buffers of the services (package meshtrain.<service>.v1) and their generated stubs.

The foundation runs everything in-process (the embedded default); the dataloader and
checkpoint services add their `.proto` files and stubs here.
"""
