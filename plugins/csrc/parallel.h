// How the kernels split a loop between threads: parallel_for, a drop-in for at::parallel_for.
//
// at::parallel_for opens an OpenMP region per call. On the 2-core VMs measured, a fork and join
// of libgomp's team cost 0.6-1.8 µs (75 µs where its threads had gone to sleep), and a decode
// step makes ~240 such calls (every GEMV, attention, SwiGLU), each doing a few microseconds of
// work. A Team keeps the threads in one region for a whole step instead: the thread running the
// step (the driver) posts each loop to the others, which spin on its counter, take their share
// and count themselves done. The split is at::parallel_for's (chunks of ceil(n / parts), thread i
// the i-th), so every output is computed by the same code on the same range either way.
//
// Inside a team, torch ops run on the driver alone (OpenMP sees a region already open), so a
// step opens one only where its work is kiln's kernels (decode_layers, ops/).
// No includes here: library.cpp brings <omp.h>, <atomic>, <mutex> and <thread> first.

class Team {
 public:
  // Run body() on this thread with the other OpenMP threads waiting for its parallel_for loops;
  // without other threads (one thread, or already inside a region), body() runs alone.
  template <typename Body>
  static void run(const Body& body) {
    if (at::get_num_threads() < 2 || omp_in_parallel()) return body();
    Team team;
    std::exception_ptr failure;
#pragma omp parallel  // no num_threads clause: PyTorch avoids it too (GOMP's pool, pytorch#32008)
    {
      if (omp_get_thread_num() == 0) {
        team.size_ = omp_get_num_threads();
        current() = &team;
        try {
          body();
        } catch (...) {
          failure = std::current_exception();
        }
        current() = nullptr;
        team.done_.store(true, std::memory_order_release);
      } else {
        team.help(omp_get_thread_num());
      }
    }
    if (failure) std::rethrow_exception(failure);
  }

  // The team the calling thread drives, or null
  static Team*& current() {
    static thread_local Team* team = nullptr;
    return team;
  }

  int64_t size() const { return size_; }

  // f over [begin, end) split as at::parallel_for splits it between this team's threads
  template <typename F>
  void loop(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t n = end - begin;
    int64_t parts = size_;
    if (grain > 0) parts = std::min(parts, (n + grain - 1) / grain);
    if (parts < 2 || n < 2) return serial(begin, end, f);
    f_ = &f;
    invoke_ = [](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); };
    begin_ = begin, end_ = end, chunk_ = (n + parts - 1) / parts;
    pending_.store(size_ - 1, std::memory_order_relaxed);  // every helper answers, with a share or without
    generation_.fetch_add(1, std::memory_order_release);
    std::exception_ptr own;
    try {
      serial(begin, std::min(end, begin + chunk_), f);
    } catch (...) {
      own = std::current_exception();
    }
    for (int64_t spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) relax(spins);
    if (own) std::rethrow_exception(own);
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  }

  // true while this thread runs a share of a loop (a loop inside one runs on this thread alone)
  static bool& in_loop() {
    static thread_local bool inside = false;
    return inside;
  }

 private:
  // in_loop() set for one share, restored however the share ends
  struct InLoop {
    const bool was = in_loop();
    InLoop() { in_loop() = true; }
    ~InLoop() { in_loop() = was; }
  };

  template <typename F>
  static void serial(int64_t begin, int64_t end, const F& f) {
    const InLoop share;
    f(begin, end);
  }

  // Spin while the wait is short; past 50,000 pauses (a millisecond or more: the driver is in a
  // long serial stretch, or the machine has more busy threads than cores) give the core away too.
  static void relax(int64_t spins) {
    _mm_pause();
    if (spins > 50000) std::this_thread::yield();
  }

  void help(int64_t tid) {
    uint64_t seen = 0;
    for (int64_t spins = 0;; ++spins) {
      const uint64_t now = generation_.load(std::memory_order_acquire);
      if (now == seen) {
        if (done_.load(std::memory_order_acquire)) return;
        relax(spins);
        continue;
      }
      seen = now, spins = 0;
      const int64_t b = begin_ + tid * chunk_;
      if (b < end_) {
        try {
          const InLoop share;
          invoke_(f_, b, std::min(end_, b + chunk_));
        } catch (...) {
          const std::lock_guard<std::mutex> lock(failure_mutex_);
          if (!failure_) failure_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  int64_t size_ = 1;
  // the loop posted last: written by the driver before generation_ moves, read by helpers after
  const void* f_ = nullptr;
  void (*invoke_)(const void*, int64_t, int64_t) = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> pending_{0};
  alignas(64) std::atomic<bool> done_{false};
  std::mutex failure_mutex_;
  std::exception_ptr failure_;
};

// f(begin_share, end_share) over [begin, end) in shares of at least grain: the calling thread's
// team if it drives one, at::parallel_for otherwise (inline inside a share)
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (Team::in_loop()) return f(begin, end);
  if (Team* team = Team::current()) return team->loop(begin, end, grain, f);
  at::parallel_for(begin, end, grain, f);
}

// The threads a parallel_for called here splits between
inline int64_t thread_count() {
  if (Team::in_loop()) return 1;
  const Team* team = Team::current();
  return team ? team->size() : at::get_num_threads();
}
