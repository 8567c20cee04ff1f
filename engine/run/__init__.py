"""Running a model: the instrumented prefill and decode loop, an experiment's lifecycle, batching and scheduling,
speculative decoding, paged and disaggregated caches, injected faults."""
