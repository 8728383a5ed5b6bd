"""pdpair's KV connector for vLLM.

``pdpair_vllm.PdpairConnector`` is the class vLLM's ``KVConnectorFactory`` loads by module path;
it is imported lazily, so the engine-API client (``pdpair_vllm.client``), the pool layout and the
engine-agnostic transfer state machines (``pdpair_vllm.transfer``) work without vLLM installed.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "PdpairConnector":
        from .connector import PdpairConnector

        return PdpairConnector
    raise AttributeError(f"module 'pdpair_vllm' has no attribute {name!r}")
