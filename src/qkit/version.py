"""qkit's version (layer 1): recorded in every manifest, export record and eval report it writes.

A module of its own so that the layers that write it import a leaf, not the package's face
(``qkit/__init__``, which imports the schemes and, lazily, the library entry points)."""

__version__ = "0.1.0"
