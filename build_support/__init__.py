"""What setup.py needs besides setuptools (not part of the installed package)."""
