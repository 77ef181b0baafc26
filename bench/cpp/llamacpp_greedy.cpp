// Greedy decoding with llama.cpp's C API, printing token ids: what tests/test_gguf_llamacpp.py
// compares pyengine's greedy tokens with. Built by bench/llamacpp_build.py (greedy_tool) against
// the static libraries of the cached llama.cpp build.
//
//   llamacpp-greedy MODEL.gguf N_PREDICT THREADS PROMPT_ID...
//
// prints one line per generated token: its id and the gap between the two largest logits of
// the step that chose it (how near a tie the choice was). End-of-generation tokens do not stop
// it: N_PREDICT tokens always. PYENGINE_LLAMACPP_REPACK=0 loads the weights without llama.cpp's
// repacking (its AMX layout crashes on some AMX CPUs: bench/llamacpp_build.py, NO_REPACK_ARGS).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT THREADS PROMPT_ID...\n", argv[0]);
    return 2;
  }
  const int n_predict = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  std::vector<llama_token> prompt;
  for (int i = 4; i < argc; ++i) prompt.push_back(static_cast<llama_token>(std::atoi(argv[i])));
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  const char* repack = std::getenv("PYENGINE_LLAMACPP_REPACK");
  if (repack != nullptr && repack[0] == '0') mp.use_extra_bufts = false;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(prompt.size() + n_predict + 16);
  cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(prompt.size());
  cp.n_threads = cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  llama_token next = 0;
  llama_batch batch = llama_batch_get_one(prompt.data(), static_cast<int32_t>(prompt.size()));
  for (int i = 0; i < n_predict; ++i) {
    if (llama_decode(ctx, batch) != 0) {
      std::fprintf(stderr, "llama_decode failed at step %d\n", i);
      return 1;
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    int best = 0, second = -1;
    for (int t = 1; t < n_vocab; ++t) {
      if (logits[t] > logits[best]) {
        second = best;
        best = t;
      } else if (second < 0 || logits[t] > logits[second]) {
        second = t;
      }
    }
    std::printf("%d %.6f\n", best, static_cast<double>(logits[best] - logits[second]));
    next = best;
    batch = llama_batch_get_one(&next, 1);
  }
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
