// pyengine/embed.hpp: the whole Python engine (pyengine.Engine) from a C++ program, through
// pybind11's embedded interpreter. Header-only; needs pybind11 (>= 2.12) and Python's embedding
// library (CMake: pybind11::embed), not pyengine's C++ core. See docs/embedding.md.
//
//   pyengine::embed::Interpreter python;          // one per process, for its whole life
//   pyengine::embed::Engine engine({/*model=*/"path/to/model"});
//   pyengine::embed::SamplingOptions greedy;
//   greedy.temperature = 0.0;
//   greedy.max_tokens = 32;
//   int64_t id = engine.add_request("Once upon a time", greedy);
//   while (engine.has_unfinished())
//     for (const auto& out : engine.step()) std::cout << out.new_text << std::flush;
//
// Threading and the GIL (the rules; docs/embedding.md says why):
//  1. One Interpreter per process. Construct it before any Engine and destroy it after the last
//     one, on the same thread (usually main(); another thread aborts the process, saying so).
//     Python is not started twice in a process: extension modules such as torch do not
//     survive Py_Finalize, so a second Interpreter, even after the first is gone, throws Error.
//  2. Between calls no C++ thread holds the GIL: the Interpreter releases it once Python is up,
//     and every Engine call takes it on entry and releases it on return. So Python threads
//     (the engine's overlap worker, torch's, the application's own) run while the C++ program
//     sleeps between ticks, and other threads of the program may use Python themselves
//     (pybind11::gil_scoped_acquire) -- a thread that keeps the GIL stalls every Engine call.
//  3. One thread drives an Engine: the thread that constructed it. A call from any other thread
//     throws Error (type "ThreadError") before it touches Python: no deadlock, no race, the
//     engine unchanged. The destructor is the exception: it may run on any thread (it takes the
//     GIL and shuts the engine down) -- but not while the owner is inside a call.
//  4. Python exceptions come out as pyengine::embed::Error, whose what() is
//     "<Python type>: <message>"; bad input (a negative max_tokens, an unknown request id)
//     changes nothing and the engine keeps serving.
#pragma once

#include <pybind11/embed.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

// Hidden, as pybind11's own namespace is: these classes hold pybind11 objects.
#if defined(__GNUC__)
#define PYENGINE_EMBED_HIDDEN __attribute__((visibility("hidden")))
#else
#define PYENGINE_EMBED_HIDDEN
#endif

namespace pyengine {
namespace embed PYENGINE_EMBED_HIDDEN {

// A Python exception (or a broken rule of this API) as a C++ exception.
class Error : public std::runtime_error {
 public:
  Error(std::string type, std::string message, std::string traceback = {})
      : std::runtime_error(type + ": " + message),
        type_(std::move(type)),
        message_(std::move(message)),
        traceback_(std::move(traceback)) {}
  // The Python exception's class name ("ValueError", "StartupError", ...); "ThreadError" and
  // "InterpreterError" for this API's own rules.
  const std::string& type() const noexcept { return type_; }
  const std::string& message() const noexcept { return message_; }
  // Python's formatted traceback ("" for this API's own errors).
  const std::string& traceback() const noexcept { return traceback_; }

 private:
  std::string type_, message_, traceback_;
};

struct InterpreterOptions {
  // The python whose installation (and virtual environment: its pyvenv.cfg) the embedded
  // interpreter takes its sys.prefix and site-packages from, e.g. "/path/to/venv/bin/python".
  // Empty: the PYENGINE_PYTHON environment variable; if that is unset too, Python's own
  // search (the first python3 on PATH, else the prefix libpython was built with).
  std::string python_executable;
  // Python's signal handlers (SIGINT -> KeyboardInterrupt at the next call). Off by default:
  // the program keeps its own handling of Ctrl-C.
  bool install_signal_handlers = false;
};

class Interpreter;

namespace detail {

namespace py = pybind11;

struct ProcessState {
  bool started = false;          // an Interpreter was constructed in this process
  const Interpreter* live = nullptr;
};
inline ProcessState& process_state() {
  static ProcessState state;
  return state;
}

// With the GIL held: the current Python exception as an Error.
inline Error to_error(py::error_already_set& e) {
  std::string type = "Exception", message = e.what(), tb;
  try {
    type = py::str(e.type().attr("__name__"));
    message = py::str(e.value());
    py::object format = py::module_::import("traceback").attr("format_exception");
    tb = py::str("").attr("join")(format(e.type(), e.value(), e.trace())).cast<std::string>();
  } catch (...) {  // keep what we have: e.what() holds type and message already
  }
  return Error(std::move(type), std::move(message), std::move(tb));
}

// With the GIL held: a pyengine module; if pyengine is not importable, an Error that says
// which Python looked for it and how to point it at the right environment.
inline py::module_ import_pyengine(const char* name) {
  try {
    return py::module_::import(name);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_ImportError)) throw;
    py::module_ sys = py::module_::import("sys");
    throw Error(py::str(e.type().attr("__name__")),
                std::string(py::str(e.value())) + " (embedded Python " + std::string(py::str(sys.attr("executable"))) +
                    ", prefix " + std::string(py::str(sys.attr("prefix"))) +
                    "): set PYENGINE_PYTHON (or InterpreterOptions::python_executable) to the python of the "
                    "environment pyengine is installed in");
  }
}

}  // namespace detail

// Starts Python (once per process) and releases the GIL; finalizes Python when destroyed.
class Interpreter {
 public:
  explicit Interpreter(const InterpreterOptions& options = {}) {
    auto& state = detail::process_state();
    if (state.started)
      throw Error("InterpreterError",
                  "Python has already been started in this process: one pyengine::embed::Interpreter per "
                  "process, for its whole life (extension modules such as torch do not survive a restart)");
    std::string exe = options.python_executable;
    if (exe.empty()) {
      if (const char* env = std::getenv("PYENGINE_PYTHON")) exe = env;
    }
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.parse_argv = 0;  // argv is the program's, not python's options
    config.install_signal_handlers = options.install_signal_handlers ? 1 : 0;
    if (!exe.empty()) {
      // Python finds a virtual environment's pyvenv.cfg next to `executable` (or one
      // directory up) and takes its site-packages.
      PyStatus status = PyConfig_SetBytesString(&config, &config.executable, exe.c_str());
      if (!PyStatus_Exception(status))
        status = PyConfig_SetBytesString(&config, &config.program_name, exe.c_str());
      if (PyStatus_Exception(status)) {
        PyConfig_Clear(&config);
        throw Error("InterpreterError", std::string("bad python executable '") + exe + "'");
      }
    }
    state.started = true;
    try {
      // no program directory on sys.path: the working directory must not shadow packages
      interpreter_.emplace(&config, 0, nullptr, /*add_program_dir_to_path=*/false);
    } catch (const std::exception& e) {
      throw Error("InterpreterError", std::string("Python failed to start: ") + e.what());
    }
    owner_ = std::this_thread::get_id();
    state.live = this;
    release_.emplace();  // rule 2: no thread holds the GIL between calls
  }

  ~Interpreter() {
    if (std::this_thread::get_id() != owner_) {  // rule 1: the GIL state saved is this thread's
      std::fputs("pyengine::embed::Interpreter destroyed on a thread other than the one that constructed it\n",
                 stderr);
      std::abort();
    }
    release_.reset();      // take the GIL back (this thread's state) ...
    interpreter_.reset();  // ... and finalize Python
    detail::process_state().live = nullptr;
  }

  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  // sys.executable, sys.prefix and sys.version of the embedded Python (to say which one runs).
  std::string python_executable() const { return sys("executable"); }
  std::string python_prefix() const { return sys("prefix"); }
  std::string python_version() const { return sys("version"); }

  // The tiny model shipped in the package (pyengine.cli.DEMO_MODEL_DIR).
  std::string demo_model_dir() const {
    pybind11::gil_scoped_acquire gil;
    try {
      return pybind11::str(detail::import_pyengine("pyengine.cli").attr("DEMO_MODEL_DIR"));
    } catch (pybind11::error_already_set& e) {
      throw detail::to_error(e);
    }
  }

  static bool alive() noexcept { return detail::process_state().live != nullptr; }

 private:
  std::string sys(const char* name) const {
    pybind11::gil_scoped_acquire gil;
    return pybind11::str(pybind11::module_::import("sys").attr(name));
  }

  std::optional<pybind11::scoped_interpreter> interpreter_;
  std::optional<pybind11::gil_scoped_release> release_;
  std::thread::id owner_;
};

// What a user needs of pyengine.Engine(...); zero / empty fields take the engine's defaults.
struct EngineOptions {
  std::string model;             // a Hugging Face model directory or a GGUF file
  std::string dtype = "float32";  // "float32", "bfloat16", "float16"
  std::string device = "cpu";     // "cpu", "cuda", "cuda:N"
  int64_t max_seq_len = 0;        // prompt + generated tokens of a request; 0: the model's
  int64_t max_batch_size = 0;     // SchedulerConfig.max_batch_size; 0: its default (64)
  int64_t max_num_tokens = 0;     // SchedulerConfig.max_num_tokens; 0: its default (2048)
  int64_t kv_max_tokens = 0;      // KvCacheConfig.max_tokens (caps the KV pool); 0: no cap
  int64_t tokens_per_block = 0;   // KvCacheConfig.tokens_per_block; 0: its default (16)
  std::optional<uint64_t> seed;   // seeds the seeds of requests that give none
  bool overlap = false;           // Engine(overlap=True): step n's forward in a worker thread
  bool exact_fp32 = false;
  std::string quantization;       // "", "q8_0", "q4_k_m", ...
  // with `quantization`: the output projection's format instead of q6_k ("": llama.cpp's choice)
  std::string lm_head_quantization;
  bool quantize_lm_head = true;   // with `quantization`, false keeps the embeddings and lm_head in float
  std::string tokenizer;          // a tokenizer directory instead of the model's
  std::string generation_config = "auto";  // "auto", "ignore" or a path
};

// SamplingParams. An unset field is not passed: it takes the model's generation_config.json
// default, then SamplingParams' -- exactly as a Python caller who leaves it out.
struct SamplingOptions {
  std::optional<int64_t> max_tokens, min_tokens, top_k;
  std::optional<double> temperature, top_p, min_p, repetition_penalty, presence_penalty,
      frequency_penalty;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;       // stop strings
  std::vector<int32_t> stop_token_ids;
  std::optional<bool> ignore_eos, include_stop_str_in_output, skip_special_tokens;
};

enum class FinishReason { none, stop, length, abort };

// One request's state after a step (pyengine's RequestOutput).
struct Output {
  int64_t request_id = -1;
  std::vector<int32_t> prompt_token_ids;
  std::vector<int32_t> token_ids;      // every token generated so far
  std::vector<int32_t> new_token_ids;  // those of this step
  std::string text, new_text;          // detokenized output so far / this step's part
  bool finished = false;
  std::string finish_reason;           // "" while running, then "stop", "length" or "abort"
  std::string stop_reason;             // the stop string or stop token id (as text) that ended it
  double time_to_first_token = -1;     // seconds, -1 before the first token

  FinishReason reason() const {
    if (finish_reason == "stop") return FinishReason::stop;
    if (finish_reason == "length") return FinishReason::length;
    if (finish_reason == "abort") return FinishReason::abort;
    return FinishReason::none;
  }
};

// pyengine.Engine in this process. Movable, not copyable; closes the engine when destroyed.
class Engine {
 public:
  explicit Engine(const EngineOptions& options) : owner_(std::this_thread::get_id()) {
    if (!Interpreter::alive())
      throw Error("InterpreterError", "construct a pyengine::embed::Interpreter before an Engine");
    pybind11::gil_scoped_acquire gil;
    try {
      engine_ = std::make_unique<pybind11::object>(construct(options));
    } catch (pybind11::error_already_set& e) {
      throw detail::to_error(e);
    } catch (const pybind11::builtin_exception& e) {  // a C++ -> Python conversion failed
      throw Error("TypeError", e.what());
    }
  }

  ~Engine() {
    if (!engine_) return;
    if (!Interpreter::alive()) {  // rule 1 broken: Python is gone, nothing can be released
      (void)engine_.release();
      return;
    }
    pybind11::gil_scoped_acquire gil;
    try {
      engine_->attr("shutdown")();
    } catch (...) {  // a destructor does not throw; the engine is dropped either way
    }
    engine_.reset();
  }

  Engine(Engine&&) noexcept = default;
  Engine& operator=(Engine&& other) noexcept {
    Engine old(std::move(other));  // this engine's previous one is closed when `old` goes
    std::swap(owner_, old.owner_);
    std::swap(engine_, old.engine_);
    return *this;
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request (text, or token ids); returns its id. Bad input throws, changing nothing.
  int64_t add_request(std::string_view prompt, const SamplingOptions& options = {}) {
    return call("add_request", [&] {
      return submit(pybind11::str(prompt.data(), prompt.size()), options);
    });
  }
  int64_t add_request(const std::vector<int32_t>& prompt_token_ids, const SamplingOptions& options = {}) {
    return call("add_request", [&] { return submit(pybind11::cast(prompt_token_ids), options); });
  }

  // One step: the outputs of the requests that advanced or ended in it.
  std::vector<Output> step() {
    return call("step", [&] {
      pybind11::list outs = (*engine_).attr("step")();
      std::vector<Output> result;
      result.reserve(outs.size());
      for (pybind11::handle o : outs) result.push_back(to_output(o));
      return result;
    });
  }

  // Cancels a waiting or running request; its final output (finish_reason "abort") comes from
  // the next step(). False if it has already finished; an unknown id throws.
  bool abort(int64_t request_id) {
    return call("abort", [&] { return (*engine_).attr("abort_request")(request_id).cast<bool>(); });
  }

  bool has_unfinished() {
    return call("has_unfinished", [&] { return (*engine_).attr("has_unfinished_requests")().cast<bool>(); });
  }

  // pyengine's Engine.stats(): num_requests, num_waiting, num_active, num_blocks,
  // num_free_blocks, num_slots, num_free_slots, prefix-reuse totals.
  std::map<std::string, int64_t> stats() {
    return call("stats", [&] { return (*engine_).attr("stats")().cast<std::map<std::string, int64_t>>(); });
  }

  // pyengine's Engine.startup_report() as JSON text: the start-up phases, the KV capacity, the
  // CPU kernels' level, what the weights are (source, bytes by format, output projection), ...
  // (values JSON cannot hold, such as a path, as their text).
  std::string startup_report_json() {
    return call("startup_report_json", [&] {
      pybind11::object report = (*engine_).attr("startup_report")();
      pybind11::module_ json = pybind11::module_::import("json");
      pybind11::dict kw;
      kw["default"] = pybind11::module_::import("builtins").attr("str");
      return json.attr("dumps")(report, **kw).cast<std::string>();
    });
  }

  // Releases the model and the KV pool (also done by the destructor); later calls throw.
  void close() {
    call("close", [&] {
      (*engine_).attr("shutdown")();
      return 0;
    });
  }

 private:
  static pybind11::object construct(const EngineOptions& o) {
    namespace py = pybind11;
    py::module_ pe = detail::import_pyengine("pyengine");
    py::dict kw;
    kw["dtype"] = o.dtype;
    kw["device"] = o.device;
    if (o.max_seq_len) kw["max_seq_len"] = o.max_seq_len;
    if (o.seed) kw["seed"] = *o.seed;
    kw["overlap"] = o.overlap;
    kw["exact_fp32"] = o.exact_fp32;
    if (!o.quantization.empty()) kw["quantization"] = o.quantization;
    if (!o.lm_head_quantization.empty()) kw["lm_head_quantization"] = o.lm_head_quantization;
    kw["quantize_lm_head"] = o.quantize_lm_head;
    if (!o.tokenizer.empty()) kw["tokenizer"] = o.tokenizer;
    kw["generation_config"] = o.generation_config;
    py::dict sched, kv;
    if (o.max_batch_size) sched["max_batch_size"] = o.max_batch_size;
    if (o.max_num_tokens) sched["max_num_tokens"] = o.max_num_tokens;
    if (o.kv_max_tokens) kv["max_tokens"] = o.kv_max_tokens;
    if (o.tokens_per_block) kv["tokens_per_block"] = o.tokens_per_block;
    if (sched.size()) kw["scheduler_config"] = pe.attr("SchedulerConfig")(**sched);
    if (kv.size()) kw["kv_cache_config"] = pe.attr("KvCacheConfig")(**kv);
    return pe.attr("Engine")(o.model, **kw);
  }

  int64_t submit(const pybind11::object& prompt, const SamplingOptions& s) {
    namespace py = pybind11;
    py::dict kw;
    auto put = [&](const char* name, const auto& field) {
      if (field) kw[name] = *field;
    };
    put("max_tokens", s.max_tokens);
    put("min_tokens", s.min_tokens);
    put("top_k", s.top_k);
    put("temperature", s.temperature);
    put("top_p", s.top_p);
    put("min_p", s.min_p);
    put("repetition_penalty", s.repetition_penalty);
    put("presence_penalty", s.presence_penalty);
    put("frequency_penalty", s.frequency_penalty);
    put("seed", s.seed);
    put("ignore_eos", s.ignore_eos);
    put("include_stop_str_in_output", s.include_stop_str_in_output);
    put("skip_special_tokens", s.skip_special_tokens);
    if (!s.stop.empty()) kw["stop"] = s.stop;
    if (!s.stop_token_ids.empty()) kw["stop_token_ids"] = s.stop_token_ids;
    py::object params = py::module_::import("pyengine").attr("SamplingParams")(**kw);
    return (*engine_).attr("add_request")(prompt, params).cast<int64_t>();
  }

  static Output to_output(pybind11::handle o) {
    namespace py = pybind11;
    Output out;
    out.request_id = o.attr("request_id").cast<int64_t>();
    out.prompt_token_ids = o.attr("prompt_token_ids").cast<std::vector<int32_t>>();
    out.token_ids = o.attr("token_ids").cast<std::vector<int32_t>>();
    out.new_token_ids = o.attr("new_token_ids").cast<std::vector<int32_t>>();
    out.text = o.attr("text").cast<std::string>();
    out.new_text = o.attr("new_text").cast<std::string>();
    out.finished = o.attr("finished").cast<bool>();
    py::object reason = o.attr("finish_reason"), stop = o.attr("stop_reason"), metrics = o.attr("metrics");
    if (!reason.is_none()) out.finish_reason = py::str(reason);
    if (!stop.is_none()) out.stop_reason = py::str(stop);
    if (!metrics.is_none()) {
      py::object ttft = metrics.attr("time_to_first_token");
      if (!ttft.is_none()) out.time_to_first_token = ttft.cast<double>();
    }
    return out;
  }

  // Rule 3, then the GIL, then Python errors as Error.
  template <class F>
  auto call(const char* name, F&& body) -> decltype(body()) {
    if (std::this_thread::get_id() != owner_)
      throw Error("ThreadError", std::string("Engine::") + name +
                                     "() was called from a thread other than the one that constructed the engine: "
                                     "one thread drives an engine (see pyengine/embed.hpp)");
    if (!engine_) throw Error("RuntimeError", "the engine has been moved from");
    pybind11::gil_scoped_acquire gil;
    try {
      return body();
    } catch (pybind11::error_already_set& e) {
      throw detail::to_error(e);
    } catch (const pybind11::builtin_exception& e) {  // e.g. cast_error: a value of the wrong type
      throw Error("TypeError", e.what());
    }
  }

  std::thread::id owner_;
  // a pointer, so that a moved-from Engine holds nothing (and needs no GIL to be destroyed)
  std::unique_ptr<pybind11::object> engine_;
};

}  // namespace embed
}  // namespace pyengine
