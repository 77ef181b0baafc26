// pyengine/embed.hpp against the real Python engine on the package's demo model: errors carry
// Python's type and message and leave the engine serving, abort, stats, token-id prompts, the
// one-thread rule, the GIL released between calls, the one-interpreter rule.
#include <pyengine/embed.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "test_harness.h"

namespace pe = pyengine::embed;

namespace {

std::optional<pe::Interpreter> g_python;
std::optional<pe::Engine> g_engine;  // one engine for the tests (start-up takes seconds)

pe::Engine& engine() { return *g_engine; }

pe::SamplingOptions greedy(int64_t max_tokens) {
  pe::SamplingOptions s;
  s.temperature = 0.0;
  s.max_tokens = max_tokens;
  s.ignore_eos = true;
  return s;
}

// Steps until request `id` finishes; its final output.
pe::Output run_to_end(int64_t id) {
  for (int i = 0; i < 1000; ++i)
    for (pe::Output& out : engine().step())
      if (out.request_id == id && out.finished) return out;
  throw std::runtime_error("request did not finish in 1000 steps");
}

// The Error a call throws (a test failure if it throws none).
template <class F>
pe::Error error_of(F&& f) {
  try {
    f();
  } catch (const pe::Error& e) {
    return e;
  }
  return pe::Error("none", "no exception");
}

}  // namespace

TEST(python_is_the_one_pyengine_python_names_with_its_environment) {
  const char* want = std::getenv("PYENGINE_PYTHON");
  const char* prefix = std::getenv("PYENGINE_EXPECTED_PREFIX");  // its sys.prefix: a venv's own
  CHECK(want != nullptr && prefix != nullptr);  // ctest sets both (tests/cpp/embed.cmake)
  if (want) CHECK_EQ(g_python->python_executable(), std::string(want));
  if (prefix) CHECK_EQ(g_python->python_prefix(), std::string(prefix));
}

TEST(negative_max_tokens_is_a_value_error_and_the_engine_keeps_serving) {
  pe::SamplingOptions bad;
  bad.max_tokens = -1;
  pe::Error e = error_of([&] { engine().add_request("Hello", bad); });
  CHECK_EQ(e.type(), std::string("ValueError"));
  CHECK_EQ(e.message(), std::string("max_tokens must be at least 1, got -1"));
  CHECK_EQ(std::string(e.what()), std::string("ValueError: max_tokens must be at least 1, got -1"));
  CHECK(e.traceback().find("max_tokens must be at least 1") != std::string::npos);
  CHECK(!engine().has_unfinished());
  pe::Output out = run_to_end(engine().add_request("Hello", greedy(5)));
  CHECK_EQ(out.finish_reason, std::string("length"));
  CHECK_EQ(out.token_ids.size(), size_t{5});
}

TEST(an_empty_prompt_is_a_value_error) {
  pe::Error e = error_of([&] { engine().add_request(std::vector<int32_t>{}, greedy(4)); });
  CHECK_EQ(std::string(e.what()), std::string("ValueError: prompt is empty"));
}

TEST(an_unknown_model_directory_is_an_error_with_pythons_message) {
  pe::EngineOptions o;
  o.model = "/nonexistent/model-dir";
  pe::Error e = error_of([&] { pe::Engine bad(o); });
  CHECK_EQ(e.type(), std::string("StartupError"));
  CHECK_EQ(e.message(),
           std::string("pyengine start-up failed in phase 'config': FileNotFoundError: model directory "
                       "'/nonexistent/model-dir' does not exist (pyengine loads models from a local directory: "
                       "config.json, *.safetensors, tokenizer files; or from a GGUF file)"));
}

TEST(abort_mid_way_ends_the_request_with_abort) {
  const int64_t id = engine().add_request("Tell me a long story", greedy(100));
  for (int i = 0; i < 4; ++i) engine().step();  // prefill and 3 decode steps: 4 tokens
  CHECK(engine().abort(id));
  std::vector<pe::Output> outs = engine().step();
  CHECK_EQ(outs.size(), size_t{1});
  if (outs.size() == 1) {
    CHECK_EQ(outs[0].request_id, id);
    CHECK(outs[0].finished);
    CHECK_EQ(outs[0].finish_reason, std::string("abort"));
    CHECK(outs[0].reason() == pe::FinishReason::abort);
    CHECK_EQ(outs[0].token_ids.size(), size_t{4});
  }
  CHECK(!engine().abort(id));  // already finished
  pe::Error e = error_of([&] { engine().abort(123456789); });
  CHECK_EQ(std::string(e.what()), std::string("ValueError: unknown request_id 123456789"));
}

TEST(stats_after_completion_show_every_slot_and_block_free) {
  run_to_end(engine().add_request("Once upon a time", greedy(6)));
  CHECK(!engine().has_unfinished());
  auto stats = engine().stats();
  CHECK_EQ(stats.at("num_requests"), int64_t{0});
  CHECK_EQ(stats.at("num_active"), int64_t{0});
  CHECK(stats.at("num_slots") > 0);
  CHECK_EQ(stats.at("num_free_slots"), stats.at("num_slots"));
  CHECK_EQ(stats.at("num_free_blocks"), stats.at("num_blocks"));
}

TEST(a_token_id_prompt_gives_the_tokens_of_the_same_prompt_as_text) {
  pe::Output text = run_to_end(engine().add_request("The \"for\" statement", greedy(12)));
  CHECK(!text.prompt_token_ids.empty());
  pe::Output ids = run_to_end(engine().add_request(text.prompt_token_ids, greedy(12)));
  CHECK_EQ(ids.prompt_token_ids, text.prompt_token_ids);
  CHECK_EQ(ids.token_ids, text.token_ids);
  CHECK_EQ(ids.text, text.text);
  CHECK_EQ(ids.token_ids.size(), size_t{12});
}

TEST(streamed_pieces_add_up_to_the_final_output) {
  const int64_t id = engine().add_request("Hello", greedy(8));
  std::vector<int32_t> ids;
  std::string text;
  pe::Output last;
  while (engine().has_unfinished())
    for (const pe::Output& out : engine().step()) {
      ids.insert(ids.end(), out.new_token_ids.begin(), out.new_token_ids.end());
      text += out.new_text;
      last = out;
    }
  CHECK_EQ(last.request_id, id);
  CHECK_EQ(ids, last.token_ids);
  CHECK_EQ(text, last.text);
  CHECK(last.time_to_first_token >= 0);
}

TEST(a_call_from_another_thread_is_a_thread_error_and_changes_nothing) {
  std::vector<pe::Error> errors;
  std::thread other([&] {
    errors.push_back(error_of([&] { engine().add_request("Hello", greedy(4)); }));
    errors.push_back(error_of([&] { engine().step(); }));
  });
  other.join();
  CHECK_EQ(errors.size(), size_t{2});
  CHECK_EQ(errors[0].type(), std::string("ThreadError"));
  CHECK_EQ(errors[0].message(),
           std::string("Engine::add_request() was called from a thread other than the one that constructed the "
                       "engine: one thread drives an engine (see pyengine/embed.hpp)"));
  CHECK_EQ(errors[1].type(), std::string("ThreadError"));
  CHECK(!engine().has_unfinished());
  CHECK_EQ(engine().stats().at("num_requests"), int64_t{0});
}

TEST(no_thread_holds_the_gil_between_calls) {
  // Another thread of the program runs Python while the engine's thread is between calls.
  std::future<long> other = std::async(std::launch::async, [] {
    pybind11::gil_scoped_acquire gil;
    return pybind11::eval("sum(range(10))").cast<long>();
  });
  if (other.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: a second thread could not take the GIL (deadlock)\n");
    std::_Exit(1);
  }
  CHECK_EQ(other.get(), 45L);
}

TEST(an_overlap_engine_gives_the_same_tokens) {
  // overlap=True runs the forward in a Python worker thread: it needs the GIL that the
  // engine's thread leaves free between calls
  pe::EngineOptions o;
  o.model = g_python->demo_model_dir();
  o.overlap = true;
  pe::Engine overlapped(o);
  const int64_t id = overlapped.add_request("The \"for\" statement", greedy(10));
  pe::Output last;
  while (overlapped.has_unfinished())
    for (pe::Output& out : overlapped.step())
      if (out.request_id == id) last = out;
  CHECK_EQ(last.finish_reason, std::string("length"));
  CHECK_EQ(last.token_ids, run_to_end(engine().add_request("The \"for\" statement", greedy(10))).token_ids);
}

TEST(quantization_options_reach_the_engine) {
  // the engine's own checks see each option (and name it), and a quantized engine serves
  pe::EngineOptions o;
  o.model = g_python->demo_model_dir();
  o.lm_head_quantization = "q4_0";
  pe::Error e = error_of([&] { pe::Engine bad(o); });
  CHECK_EQ(e.type(), std::string("StartupError"));
  CHECK(e.message().find("lm_head_quantization='q4_0' needs quantization=") != std::string::npos);
  o.lm_head_quantization.clear();
  o.quantize_lm_head = false;
  e = error_of([&] { pe::Engine bad(o); });
  CHECK(e.message().find("quantize_lm_head=False needs quantization=") != std::string::npos);
  o.quantization = "q8_0";
  o.quantize_lm_head = true;
  o.lm_head_quantization = "q4_0";
  pe::Engine quantized(o);
  const std::string report = quantized.startup_report_json();  // what the engine made of the options
  CHECK(report.find("\"source\": \"quantized at load\"") != std::string::npos);
  CHECK(report.find("\"output_projection\": \"q4_0\"") != std::string::npos);
  const int64_t id = quantized.add_request("The \"for\" statement", greedy(6));
  pe::Output last;
  while (quantized.has_unfinished())
    for (pe::Output& out : quantized.step())
      if (out.request_id == id) last = out;
  CHECK_EQ(last.token_ids.size(), size_t{6});
}

TEST(an_engine_moves_and_a_moved_from_engine_says_so) {
  pe::Engine moved(std::move(*g_engine));
  pe::Error e = error_of([&] { g_engine->step(); });
  CHECK_EQ(std::string(e.what()), std::string("RuntimeError: the engine has been moved from"));
  *g_engine = std::move(moved);
  CHECK_EQ(run_to_end(engine().add_request("Hello", greedy(3))).token_ids.size(), size_t{3});
}

TEST(a_second_interpreter_is_refused) {
  pe::Error e = error_of([] { pe::Interpreter again; });
  CHECK_EQ(e.type(), std::string("InterpreterError"));
  CHECK(e.message().find("one pyengine::embed::Interpreter per process") != std::string::npos);
}

TEST(a_closed_engine_refuses_calls) {
  pe::EngineOptions o;
  o.model = g_python->demo_model_dir();
  pe::Engine other(o);
  other.close();
  pe::Error e = error_of([&] { other.step(); });
  CHECK_EQ(std::string(e.what()), std::string("RuntimeError: the engine has been shut down"));
}

int main() {
  try {
    g_python.emplace();
    pe::EngineOptions o;
    o.model = g_python->demo_model_dir();
    g_engine.emplace(o);
  } catch (const pe::Error& e) {
    std::fprintf(stderr, "test_embed: cannot start the engine: %s\n", e.what());
    return 1;
  }
  const int rc = test::run_all();
  g_engine.reset();  // engines go before the interpreter (rule 1)
  g_python.reset();
  return rc;
}
