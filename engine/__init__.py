"""KVScope's engine: runs a real language model and reports what happened as a stream of events.

Importing this package is cheap and never imports torch or Qt: the app imports it to read traces and to
compute formulas before (or without) loading a model. Modules that need torch import it themselves.
"""

__version__ = "0.1.0"
