"""Serving-cost analyses: KV cache size, memory budget per card, speculative decoding, measured
prefill/decode/batching costs, and a static-vs-continuous batching simulator.

One module per command, each a plain function returning a report dataclass (``to_dict()`` for JSON):
``kv.kv_report``, ``budget.budget``, ``speculate.speculate``, ``bench.bench``, ``batching.simulate_batching``.
``qkit.cli`` renders them. Nothing is re-exported here: three functions share their module's name.
"""
