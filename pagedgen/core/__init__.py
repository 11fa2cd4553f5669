"""The few types and paths that ops, models and the executor share, so each depends on this, never on another.

``step_inputs`` is the packed input of one model call, ``kv`` the paged KV cache's geometry and storage,
``paths`` the cache directory. This package imports nothing else from pagedgen.
"""
