"""A model loaded and made fast: formats, conversions, kernels, compiled graphs, the cache it builds and the one
forward call, sampling, and this machine's peaks."""

from engine.model import hqq_deferred

hqq_deferred.defer()
