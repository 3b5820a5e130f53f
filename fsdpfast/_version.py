"""The package's version, on its own so that modules below the face (manifest) can name it."""

__version__ = "0.1.0"
