// A fixed-rate control loop that embeds the Python engine (pyengine/embed.hpp): each tick
// does the robot's own work, gives the engine one step(), streams a reply as it arrives, and
// cancels a second request mid-way. Prints each tick's step time and a summary.
//
//   robot_loop [--model DIR] [--prompt TEXT] [--max-tokens N] [--hz HZ] [--abort-after TICKS]
//              [--print-tokens]
//
// --model defaults to the tiny model shipped in the package (pyengine.cli.DEMO_MODEL_DIR).
// --print-tokens adds a line "TOKENS id id ..." with the streamed reply's token ids.
// The embedded Python is the one PYENGINE_PYTHON names (else the first python3 on PATH).
#include <pyengine/embed.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
namespace pe = pyengine::embed;

struct Args {
  std::string model, prompt = "The \"for\" statement";
  int64_t max_tokens = 24;
  double hz = 50.0;
  int abort_after = 8;
  bool print_tokens = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "robot_loop: %s\nusage: robot_loop [--model DIR] [--prompt TEXT] [--max-tokens N] [--hz HZ] "
               "[--abort-after TICKS] [--print-tokens]\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage((flag + " needs a value").c_str());
      return argv[++i];
    };
    if (flag == "--model") a.model = value();
    else if (flag == "--prompt") a.prompt = value();
    else if (flag == "--max-tokens") a.max_tokens = std::stoll(value());
    else if (flag == "--hz") a.hz = std::stod(value());
    else if (flag == "--abort-after") a.abort_after = std::stoi(value());
    else if (flag == "--print-tokens") a.print_tokens = true;
    else usage(("unknown argument " + flag).c_str());
  }
  if (!(a.hz > 0)) usage("--hz must be > 0");
  return a;
}

// new_text on one line, in quotes: newlines, tabs and quotes escaped
std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '"') out += "\\\"";
    else out += c;
  }
  return out;
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

int run(const Args& args) {
  pe::Interpreter python;  // one per process; releases the GIL between engine calls
  pe::EngineOptions options;
  options.model = args.model.empty() ? python.demo_model_dir() : args.model;
  options.max_batch_size = 4;
  pe::Engine engine(options);

  pe::SamplingOptions greedy;  // the reply: greedy, with the demo model's repetition penalty
  greedy.temperature = 0.0;
  greedy.repetition_penalty = 1.3;
  greedy.max_tokens = args.max_tokens;
  pe::SamplingOptions chatter;  // a long sampled request that the loop cancels
  chatter.temperature = 0.8;
  chatter.seed = 1;
  chatter.max_tokens = 200;
  chatter.ignore_eos = true;

  const int64_t reply = engine.add_request(args.prompt, greedy);
  const int64_t cancelled = engine.add_request("Say something long", chatter);
  std::printf("robot_loop: %.0f Hz, model %s\nreply %lld: [%s]\n", args.hz, options.model.c_str(),
              static_cast<long long>(reply), args.prompt.c_str());

  const auto period = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / args.hz));
  std::vector<double> step_ms;
  int overruns = 0;
  pe::Output reply_out, cancelled_out;
  auto deadline = Clock::now() + period;
  for (int tick = 0; engine.has_unfinished(); ++tick) {
    // ... the robot's own work for this tick goes here ...
    if (tick == args.abort_after) engine.abort(cancelled);
    const auto t0 = Clock::now();
    std::vector<pe::Output> outs = engine.step();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    step_ms.push_back(ms);
    std::string note;
    for (const pe::Output& out : outs) {
      if (out.request_id == reply) {
        reply_out = out;
        note += " reply += \"" + one_line(out.new_text) + "\"";
      } else if (out.request_id == cancelled && out.finished) {
        cancelled_out = out;
        note += " request " + std::to_string(cancelled) + " " + out.finish_reason + " after " +
                std::to_string(out.token_ids.size()) + " tokens";
      }
      if (out.request_id == reply && out.finished) note += " [" + out.finish_reason + "]";
    }
    std::printf("tick %4d  step %7.2f ms %s\n", tick, ms, note.c_str());
    std::fflush(stdout);
    if (Clock::now() > deadline) {
      ++overruns;
      deadline = Clock::now();  // late: start the next tick now instead of bunching up
    }
    std::this_thread::sleep_until(deadline);
    deadline += period;
  }

  double sum = 0, max = 0;
  for (double v : step_ms) sum += v, max = std::max(max, v);
  std::printf("reply (%s, %zu tokens): [%s]%s\n", reply_out.finish_reason.c_str(), reply_out.token_ids.size(),
              args.prompt.c_str(), reply_out.text.c_str());
  std::printf("request %lld: %s after %zu tokens\n", static_cast<long long>(cancelled),
              cancelled_out.finish_reason.c_str(), cancelled_out.token_ids.size());
  std::printf("steps %zu: mean %.2f ms, p50 %.2f ms, p99 %.2f ms, max %.2f ms; ticks overrun %d (period %.1f ms)\n",
              step_ms.size(), sum / static_cast<double>(step_ms.size()), percentile(step_ms, 50),
              percentile(step_ms, 99), max, overruns, 1000.0 / args.hz);
  std::printf("stats:");
  for (const auto& [name, value] : engine.stats()) std::printf(" %s=%lld", name.c_str(), static_cast<long long>(value));
  std::printf("\n");
  if (args.print_tokens) {
    std::printf("TOKENS");
    for (int32_t id : reply_out.token_ids) std::printf(" %d", id);
    std::printf("\n");
  }
  if (!reply_out.finished || cancelled_out.finish_reason != "abort") {
    std::fprintf(stderr, "robot_loop: the reply did not finish or the cancelled request did not end in abort\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  try {
    return run(args);
  } catch (const pyengine::embed::Error& e) {
    std::fprintf(stderr, "robot_loop: %s\n", e.what());
    return 1;
  }
}
