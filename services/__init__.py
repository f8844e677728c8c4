"""meshtrain services: dataloader, checkpoint and trainer, each also a plain Python library."""

if (
    __name__ != "meshtrain.services"
):  # one name per file: this folder installs as meshtrain.services
    raise ImportError(
        f"import meshtrain.services{__name__[len('services') :]}, not {__name__}: the repository's "
        "services/ folder is the package meshtrain.services"
    )
