// A minimal test harness: TEST(name) registers a test; CHECK / CHECK_EQ / CHECK_NEAR / CHECK_THROWS
// record failures with file and line. main() runs every test and exits non-zero on failure.
#pragma once

#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace test {

struct Registry {
  std::vector<std::pair<std::string, std::function<void()>>> tests;
  int failures = 0;
  static Registry& get() {
    static Registry r;
    return r;
  }
};

struct Register {
  Register(const char* name, std::function<void()> fn) { Registry::get().tests.emplace_back(name, std::move(fn)); }
};

inline void fail(const char* file, int line, const std::string& what) {
  ++Registry::get().failures;
  std::cerr << file << ":" << line << ": FAILED: " << what << "\n";
}

template <typename T>
std::string show(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
template <typename T>
std::string show(const std::vector<T>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

template <typename K, typename V>
std::string show(const std::map<K, V>& m) {
  std::ostringstream os;
  os << "{";
  bool first = true;
  for (const auto& kv : m) {
    os << (first ? "" : ", ") << kv.first << ": " << kv.second;
    first = false;
  }
  os << "}";
  return os.str();
}

inline int run_all() {
  int failed_tests = 0;
  for (auto& t : Registry::get().tests) {
    const int before = Registry::get().failures;
    try {
      t.second();
    } catch (const std::exception& e) {
      fail(t.first.c_str(), 0, std::string("uncaught exception: ") + e.what());
    }
    const bool ok = Registry::get().failures == before;
    failed_tests += ok ? 0 : 1;
    std::cout << (ok ? "[ OK ] " : "[FAIL] ") << t.first << "\n";
  }
  const int n = static_cast<int>(Registry::get().tests.size());
  std::cout << (n - failed_tests) << " passed, " << failed_tests << " failed\n";
  return failed_tests == 0 && n > 0 ? 0 : 1;
}

}  // namespace test

#define TEST(name)                                             \
  static void name();                                          \
  static test::Register register_##name(#name, name);          \
  static void name()

#define CHECK(cond) \
  do { if (!(cond)) test::fail(__FILE__, __LINE__, #cond); } while (0)

#define CHECK_EQ(a, b)                                                                        \
  do {                                                                                        \
    auto va_ = (a);                                                                           \
    auto vb_ = (b);                                                                           \
    if (!(va_ == vb_))                                                                        \
      test::fail(__FILE__, __LINE__, std::string(#a " == " #b ": ") + test::show(va_) + " vs " + test::show(vb_)); \
  } while (0)

#define CHECK_NEAR(a, b, tol)                                                                 \
  do {                                                                                        \
    const double va_ = (a), vb_ = (b);                                                        \
    if (!(std::abs(va_ - vb_) <= (tol)))                                                      \
      test::fail(__FILE__, __LINE__, std::string(#a " ~= " #b ": ") + test::show(va_) + " vs " + test::show(vb_)); \
  } while (0)

#define CHECK_THROWS(expr, ExcType, substring)                                                  \
  do {                                                                                          \
    bool thrown_ = false;                                                                       \
    try { expr; } catch (const ExcType& e_) {                                                   \
      thrown_ = true;                                                                           \
      if (std::string(e_.what()).find(substring) == std::string::npos)                          \
        test::fail(__FILE__, __LINE__, std::string("message '") + e_.what() + "' lacks '" + substring + "'"); \
    }                                                                                           \
    if (!thrown_) test::fail(__FILE__, __LINE__, #expr " did not throw " #ExcType);           \
  } while (0)

#define TEST_MAIN() \
  int main() { return test::run_all(); }
