"""The directory ``torshmon run`` puts first on the children's PYTHONPATH: its
``sitecustomize`` attaches the probe to an unmodified training script (autoattach.py)."""
