"""omnipipe: serve omni-modality models as independently scaled, streaming stages."""

__version__ = "0.1.0"
