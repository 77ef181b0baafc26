"""pyengine: an embedded, single-process LLM inference engine.

    from pyengine import Engine, SamplingParams
    engine = Engine("path/to/hf-model")
    rid = engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...
"""

from pyengine.config import KvCacheConfig, SchedulerConfig
from pyengine.engine import Engine, StartupError
from pyengine.engine.outputs import RequestMetrics, RequestOutput
from pyengine.layers.cpu_features import CpuInfo, cpu_info
from pyengine.sampling import GuidedDecodingParams, SamplingParams

__all__ = ["Engine", "KvCacheConfig", "SchedulerConfig", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "RequestMetrics",
           "StartupError", "CpuInfo", "cpu_info"]
__version__ = "0.1.0"
