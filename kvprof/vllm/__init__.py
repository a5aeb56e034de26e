"""vLLM adaptor: serve kvprof's eviction policies inside vLLM (0.30-0.33, v1 engine).

* :mod:`kvprof.vllm.plugin` -- the ``vllm.general_plugins`` entry point: ``--kv-policy-config`` and the
  engine-core hook that installs the policy-backed block pool.
* :mod:`kvprof.vllm.block_pool` -- the GPU tier: a free-block queue whose cached part is ordered by a
  kvprof policy.
* :mod:`kvprof.vllm.offload` -- the CPU offload tier: a ``CachePolicy`` for vLLM's OffloadingConnector.
* :mod:`kvprof.vllm.spec` -- what ``additional_config["kv_policy"]`` means (no vLLM import).

Only :mod:`spec` can be imported without vLLM installed.
"""
