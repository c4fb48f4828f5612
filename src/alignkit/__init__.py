"""alignkit: alignment training from one CPU to many GPU nodes with one config file."""

__version__ = "0.1.0"
