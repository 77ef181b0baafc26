"""Speculative decoding on a GPU: greedy outputs are those without speculation (CUDA graphs
on and off, the overlap loop, prompt lookup and a draft model), seeded sampling is reproducible,
and slots and blocks return to their pools. Skipped without a CUDA device (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest

from speculative_common import generate, greedy, make_prompts, seeded_params
from pyengine import Engine, KvCacheConfig, SchedulerConfig, SpeculativeConfig
from pyengine.testing.checkpoints import build_truncated_checkpoint


@pytest.fixture(scope="module")
def gpu_copying_dir(checkpoint_factory):
    """The copying model of the CPU tests at a shape the CUDA kernels are built for (head_dim 64)."""
    return checkpoint_factory("gpu_llama_copying", model_type="llama", hidden_size=256, num_heads=4,
                              num_kv_heads=2, initializer_range=0.02)


@pytest.fixture(scope="module")
def gpu_draft_dir(gpu_copying_dir, tmp_path_factory):
    return build_truncated_checkpoint(gpu_copying_dir, tmp_path_factory.mktemp("gpu_draft") / "model", 1)


def make_engine(model_dir, spec: SpeculativeConfig | None, **kw) -> Engine:
    return Engine(model_dir, device="cuda", max_seq_len=160, seed=0, speculative_config=spec,
                  overlap=kw.pop("overlap", False), cuda_graphs=kw.pop("cuda_graphs", True),
                  kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=8),
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 4),
                                                   max_num_tokens=kw.pop("max_num_tokens", 64)))


@pytest.fixture(scope="module")
def reference(gpu_copying_dir):
    return [o.token_ids for o in generate(make_engine(gpu_copying_dir, None), make_prompts(), greedy())]


@pytest.fixture(params=["ngram", "draft_model"])
def spec(request, gpu_draft_dir) -> SpeculativeConfig:
    if request.param == "ngram":
        return SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                                 adaptive_draft_length=False)
    return SpeculativeConfig(method="draft_model", draft_model=gpu_draft_dir, num_speculative_tokens=4,
                             adaptive_draft_length=False)


@pytest.mark.parametrize("setup", [dict(), dict(cuda_graphs=False), dict(overlap=True), dict(max_batch_size=1)],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_greedy_outputs_are_those_without_speculation_on_the_gpu(gpu_copying_dir, spec, reference, setup):
    engine = make_engine(gpu_copying_dir, spec, **setup)
    outs = generate(engine, make_prompts(), greedy())
    assert [o.token_ids for o in outs] == reference
    stats = engine.stats()
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]


def test_seeded_sampling_with_speculation_is_reproducible_on_the_gpu(gpu_copying_dir, spec):
    runs = [[o.token_ids for o in generate(make_engine(gpu_copying_dir, spec), make_prompts(), seeded_params())]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert all(len(t) == 40 for t in runs[0])


def test_verify_batches_replay_their_cuda_graphs(gpu_copying_dir, spec, reference):
    """Verify batches of 1..4 drafts a sequence run as graphs (padded: tests/test_verify_padding.py
    covers the padding on the CPU), with the outputs of decoding without speculation."""
    engine = make_engine(gpu_copying_dir, spec)
    assert engine.startup_report()["cuda_graph_verify_drafts"] == [1, 2, 3, 4]
    graphs = engine._runner.graphs
    replays = []
    real = graphs.replay_verify
    graphs.replay_verify = lambda size, d: replays.append((size, d)) or real(size, d)
    outs = generate(engine, make_prompts(), greedy())
    assert [o.token_ids for o in outs] == reference
    assert replays, "no verify batch replayed a graph"
    assert all(size in (1, 2, 4) and 1 <= d <= 4 for size, d in replays)
    eager = make_engine(gpu_copying_dir, spec, cuda_graphs=False)
    assert eager.startup_report()["cuda_graph_verify_drafts"] == []
