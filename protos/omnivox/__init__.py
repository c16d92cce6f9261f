"""omnivox: a multimodal speech-and-vision generation service."""

__version__ = "0.1.0"
