"""pyengine: an embedded, single-process LLM inference engine.

    from pyengine import Engine, SamplingParams
    engine = Engine("path/to/hf-model")
    rid = engine.add_request("Hello", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():
            ...
"""

# torch first, before the C++ extension: torch's wheel ships its OpenMP runtime (libgomp.so.1),
# and the extension's libgomp.so.1 then binds to that same loaded copy instead of loading a
# second runtime whose worker threads would compete with torch's (tests/test_openmp_runtime.py).
import torch  # noqa: F401  (isort: skip)

from pyengine.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig, StepCostModel
from pyengine.engine import Engine, StartupError
from pyengine.engine.kv_persistence import KvCacheFileError
from pyengine.engine.outputs import RequestMetrics, RequestOutput
from pyengine.layers.cpu_features import CpuInfo, cpu_info
from pyengine.sampling import GuidedDecodingParams, SamplingParams

__all__ = ["Engine", "KvCacheConfig", "SchedulerConfig", "SpeculativeConfig", "StepCostModel", "SamplingParams", "GuidedDecodingParams", "RequestOutput", "RequestMetrics",
           "StartupError", "KvCacheFileError", "CpuInfo", "cpu_info"]
__version__ = "0.1.0"
