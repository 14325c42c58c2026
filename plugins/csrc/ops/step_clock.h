// Where decode_layers' time goes, phase by phase, for benchmarks (benchmarks/ablations/
// decode_profile.py --phases): off until step_clock(true); while on, every phase of every layer
// adds its wall time to its total. step_clock(on) returns the totals gathered since the previous
// call as JSON, clears them and turns the clock on or off. Off, a phase costs one branch. Steps
// run one at a time (the runtime's one engine thread), so the totals are plain integers.

enum StepPhase {
  phase_linears, phase_attention, phase_norms, phase_activation, phase_experts, phase_step, kStepPhases
};
constexpr const char* kStepPhaseNames[kStepPhases] = {"linears", "attention", "norms", "activation", "experts", "step"};

inline bool g_step_clock_on = false;
inline int64_t g_step_ns[kStepPhases] = {};
inline int64_t g_step_calls = 0;

// adds its scope's wall time to a phase while the clock is on
class PhaseTimer {
 public:
  explicit PhaseTimer(StepPhase phase) : phase_(phase), on_(g_step_clock_on) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    if (!on_) return;
    g_step_ns[phase_] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start_).count();
    if (phase_ == phase_step) ++g_step_calls;
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  StepPhase phase_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

std::string step_clock(bool on) {
  std::string out = "{\"calls\": " + std::to_string(g_step_calls) + ", \"seconds\": {";
  for (int p = 0; p < kStepPhases; ++p)
    out += std::string(p ? ", " : "") + "\"" + kStepPhaseNames[p] + "\": " + std::to_string(g_step_ns[p] * 1e-9);
  std::fill(std::begin(g_step_ns), std::end(g_step_ns), 0);
  g_step_calls = 0;
  g_step_clock_on = on;
  return out + "}}";
}
