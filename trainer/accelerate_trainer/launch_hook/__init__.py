"""The folder the trainer puts on PYTHONPATH of the launcher and every rank: its
sitecustomize.py installs error_files' hooks (a package only so that it is installed)."""
