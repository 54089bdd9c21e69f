# cython: language_level=3
"""Hot loop of the 2-D {tokens, missing-expert-bytes} deficit verify scheduler.

The rules are specified in :mod:`pdflash.scheduler` (docs/scheduler.md); this module
only executes them. Requests are held by *index* in ring order (arrival
order); the Python wrapper maps request ids to indices and validates every
input before it gets here. Expert sets are bitsets: ``num_words`` uint64
words over flat ids ``g = layer * num_experts + expert`` (bit ``g % 64`` of
word ``g // 64``).

Results of :meth:`DeficitCore.step` stay in internal buffers until the next
``step``; the accessors return read-only views of them.
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.string cimport memcpy, memmove, memset

import numpy as np

cimport cython

from pdflash_native._bitops cimport (
    andnot_count,
    andnot_weighted,
    cpu_init,
    ctz64,
    set_popcnt,
    uses_popcnt,
)

cpu_init()


#: Meaning of ``DeficitCore.violation`` codes (0: none).
VIOLATIONS = {
    1: "a step with live work was empty",
    2: "request cap exceeded",
    3: "a grant outside [1, requested tokens]",
    4: "token budget exceeded",
    5: "byte budget exceeded outside the single-item oversize exception and the marginal rule",
    6: "negative deficit",
    7: "a request was scheduled twice",
}


def uses_popcnt_instruction():
    """True if the bitset kernels use the CPU's POPCNT instruction."""
    return bool(uses_popcnt())


def _set_popcnt_instruction(bint enabled):
    """Tests only: force the portable kernels (``False``) or re-detect the
    CPU (``True``), so both kernel variants are checked on one machine."""
    set_popcnt(enabled)


cdef inline int64_t _marginal_bytes(
    const uint64_t* x,
    const uint64_t* covered,
    Py_ssize_t num_words,
    const int64_t* expert_bytes,
    int64_t uniform,
    const int64_t* word_bytes,
    bint word_uniform,
    int64_t limit,
) noexcept nogil:
    """Bytes of ``x & ~covered``. With ``limit >= 0`` it may stop early and
    return a partial sum as soon as that exceeds ``limit`` (the caller only
    needs to know it does not fit)."""
    cdef Py_ssize_t w
    cdef uint64_t m
    cdef int64_t total = 0
    if uniform >= 0:
        if uniform == 0:
            return 0
        # count > limit // uniform  <=>  count * uniform > limit
        return andnot_count(
            x, covered, num_words, limit // uniform if limit >= 0 else -1
        ) * uniform
    if word_uniform:
        # NOTE: sizes uniform per word (e.g. per layer when num_experts is a
        # multiple of 64): a weighted popcount, no per-bit loop.
        return andnot_weighted(x, covered, word_bytes, num_words, limit)
    for w in range(num_words):
        m = x[w] & ~covered[w]
        while m:
            total += expert_bytes[(w << 6) + ctz64(m)]
            m &= m - 1
        if limit >= 0 and total > limit:
            return total
    return total


cdef object _grown(object old, Py_ssize_t n, object shape, object dtype):
    new = np.zeros(shape, dtype=dtype)
    if n:
        new[:n] = np.asarray(old)[:n]
    return new


@cython.auto_pickle(False)
cdef class DeficitCore:
    """State and step of the scheduler over request indices (ring order).

    Parameters are validated by :class:`pdflash.scheduler.VerifyScheduler`;
    this class only rejects what would corrupt memory or loop forever.
    """

    def __init__(
        self,
        Py_ssize_t num_flat,
        int64_t token_budget,
        int64_t byte_budget,
        double quantum,
        int64_t max_requests,
        Py_ssize_t initial_capacity=16,
        int64_t fixed_bytes=-1,
    ):
        if num_flat <= 0 or token_budget <= 0 or not (quantum > 0) or max_requests < 0:
            raise ValueError("DeficitCore: invalid sizes or budgets")
        self.fixed_bytes = fixed_bytes if byte_budget >= 0 else -1
        self.num_flat = num_flat
        self.num_words = (num_flat + 63) // 64
        self.token_budget = token_budget
        self.byte_budget = byte_budget
        self.max_requests = max_requests
        self.quantum = quantum
        self.lap = 0
        self.cursor_seq = 0
        self.visit_open = False
        self.size = 0
        self.capacity = 0
        self.uniform_bytes = 0
        self.word_uniform = False
        self.word_bytes = np.zeros(self.num_words, dtype=np.int64)
        self.resident = np.zeros(self.num_words, dtype=np.uint64)
        self.expert_bytes = np.zeros(num_flat, dtype=np.int64)
        self.covered = np.zeros(self.num_words, dtype=np.uint64)
        self.union_bits = np.zeros(self.num_words, dtype=np.uint64)
        self.a_union_ids = np.zeros(num_flat, dtype=np.int64)
        self.a_union_mask = np.zeros(num_flat, dtype=np.uint8)
        self.union_ids = self.a_union_ids
        self.union_mask = self.a_union_mask
        self.batch_size = 0
        self.union_size = 0
        self.oversize = False
        self.cap_reached = False
        self.seq = np.zeros(0, dtype=np.int64)
        self.weight = np.zeros(0, dtype=np.float64)
        self.deficit = np.zeros(0, dtype=np.float64)
        self.credit_lap = np.zeros(0, dtype=np.int64)
        self.tokens = np.zeros(0, dtype=np.int64)
        self.bits = np.zeros((0, self.num_words), dtype=np.uint64)
        self.candidates = np.zeros(0, dtype=np.int64)
        self.cand_lower = np.zeros(0, dtype=np.int64)
        self.cand_used_at = np.zeros(0, dtype=np.int64)
        self.served = np.zeros(0, dtype=np.uint8)
        self.quanta = np.zeros(0, dtype=np.float64)
        self.out_index = np.zeros(0, dtype=np.int64)
        self.out_requested = np.zeros(0, dtype=np.int64)
        self.out_grant = np.zeros(0, dtype=np.int64)
        self.out_marginal = np.zeros(0, dtype=np.int64)
        self.out_cost = np.zeros(0, dtype=np.float64)
        while self.capacity < initial_capacity:
            self._grow()

    cdef int _check_idle(self) except -1:
        # NOTE: step() scans raw pointers without the GIL; a concurrent
        # mutation (a resize above all) would be a use-after-free.
        if self.busy:
            raise RuntimeError("DeficitCore is running step() in another thread; it is not thread-safe")
        return 0

    cdef void _grow(self):
        cdef Py_ssize_t new_cap = max(16, 2 * self.capacity)
        cdef Py_ssize_t n = self.size

        self.seq = _grown(self.seq, n, new_cap, np.int64)
        self.weight = _grown(self.weight, n, new_cap, np.float64)
        self.a_deficit = _grown(self.deficit, n, new_cap, np.float64)
        self.deficit = self.a_deficit
        self.credit_lap = _grown(self.credit_lap, n, new_cap, np.int64)
        self.a_tokens = _grown(self.tokens, n, new_cap, np.int64)
        self.tokens = self.a_tokens
        self.bits = _grown(self.bits, n, (new_cap, self.num_words), np.uint64)
        self.candidates = np.zeros(new_cap, dtype=np.int64)
        self.cand_lower = np.zeros(new_cap, dtype=np.int64)
        self.cand_used_at = np.zeros(new_cap, dtype=np.int64)
        self.served = np.zeros(new_cap, dtype=np.uint8)
        self.a_quanta = np.zeros(new_cap, dtype=np.float64)
        self.quanta = self.a_quanta
        self.a_out_index = np.zeros(new_cap, dtype=np.int64)
        self.out_index = self.a_out_index
        self.a_out_requested = np.zeros(new_cap, dtype=np.int64)
        self.out_requested = self.a_out_requested
        self.a_out_grant = np.zeros(new_cap, dtype=np.int64)
        self.out_grant = self.a_out_grant
        self.a_out_marginal = np.zeros(new_cap, dtype=np.int64)
        self.out_marginal = self.a_out_marginal
        self.a_out_cost = np.zeros(new_cap, dtype=np.float64)
        self.out_cost = self.a_out_cost
        self.capacity = new_cap
        # the previous step's results are invalidated by a resize
        self.batch_size = 0

    # ---------------------------------------------------------------- events
    def append(self, int64_t seq, double weight):
        """Add a request at the end of the ring (``seq`` above every live one)."""
        self._check_idle()
        if not (weight > 0):
            raise ValueError(f"weight must be > 0, got {weight!r}")
        if self.size and seq <= self.seq[self.size - 1]:
            raise ValueError("seq must increase")
        if self.size == self.capacity:
            self._grow()
        cdef Py_ssize_t i = self.size
        self.seq[i] = seq
        self.weight[i] = weight
        self.deficit[i] = 0.0
        self.credit_lap[i] = -1
        self.tokens[i] = 0
        self.bits[i, :] = 0
        self.size += 1

    def remove(self, Py_ssize_t index):
        """Drop the request at ``index``; its credit goes with it."""
        self._check_idle()
        if index < 0 or index >= self.size:
            raise IndexError(index)
        cdef Py_ssize_t tail = self.size - index - 1
        cdef Py_ssize_t W = self.num_words
        if tail:
            memmove(&self.seq[index], &self.seq[index + 1], tail * sizeof(int64_t))
            memmove(&self.weight[index], &self.weight[index + 1], tail * sizeof(double))
            memmove(&self.deficit[index], &self.deficit[index + 1], tail * sizeof(double))
            memmove(&self.credit_lap[index], &self.credit_lap[index + 1], tail * sizeof(int64_t))
            memmove(&self.tokens[index], &self.tokens[index + 1], tail * sizeof(int64_t))
            memmove(&self.bits[index, 0], &self.bits[index + 1, 0], tail * W * sizeof(uint64_t))
        self.size -= 1
        # NOTE: indices shift; the previous step's batch indices are stale.
        self.batch_size = 0

    def set_demand(self, Py_ssize_t index, int64_t tokens, const uint64_t[::1] words):
        """Pending demand of a request: ``tokens`` = 1 + drafts, expert bitset."""
        self._check_idle()
        if index < 0 or index >= self.size:
            raise IndexError(index)
        if tokens < 1:
            raise ValueError("tokens must be >= 1")
        if words.shape[0] != self.num_words:
            raise ValueError("wrong bitset length")
        memcpy(&self.bits[index, 0], &words[0], self.num_words * sizeof(uint64_t))
        if self.tokens[index] == 0 and self.credit_lap[index] < self.lap - 1:
            # NOTE: backlogged from the current lap on; an idle request is
            # owed nothing for the laps it sat out (DRR: no credit when idle).
            self.credit_lap[index] = self.lap - 1
        self.tokens[index] = tokens

    def clear_demand(self, Py_ssize_t index):
        self._check_idle()
        if index < 0 or index >= self.size:
            raise IndexError(index)
        self.tokens[index] = 0

    def set_weights(self, const double[::1] weights):
        """Weights of all live requests, in ring order."""
        self._check_idle()
        cdef Py_ssize_t i
        if weights.shape[0] != self.size:
            raise ValueError("one weight per live request")
        for i in range(self.size):
            if not (weights[i] > 0):
                raise ValueError(f"weight must be > 0, got {weights[i]!r}")
        for i in range(self.size):
            self.weight[i] = weights[i]

    def set_resident(self, const uint64_t[::1] words):
        self._check_idle()
        if words.shape[0] != self.num_words:
            raise ValueError("wrong bitset length")
        memcpy(&self.resident[0], &words[0], self.num_words * sizeof(uint64_t))

    def set_expert_bytes(self, const int64_t[::1] sizes):
        self._check_idle()
        cdef Py_ssize_t g
        if sizes.shape[0] != self.num_flat:
            raise ValueError("one size per flat expert id")
        for g in range(self.num_flat):
            if sizes[g] < 0:
                raise ValueError("negative expert size")
        memcpy(&self.expert_bytes[0], &sizes[0], self.num_flat * sizeof(int64_t))
        self.uniform_bytes = sizes[0]
        for g in range(self.num_flat):
            if sizes[g] != self.uniform_bytes:
                self.uniform_bytes = -1
                break
        self.word_uniform = True
        for g in range(self.num_flat):
            if g % 64 == 0:
                self.word_bytes[g // 64] = sizes[g]
            elif sizes[g] != self.word_bytes[g // 64]:
                self.word_uniform = False
                break

    def set_fixed_bytes(self, int64_t fixed_bytes):
        """``F`` of the marginal rule (bytes the link moves in a step's fixed
        time); ``< 0`` makes ``M`` hard. Ignored in token-only mode. The
        wrapper bounds ``T * (F + every expert's bytes)`` so the rule's
        products stay exact."""
        self._check_idle()
        self.fixed_bytes = fixed_bytes if self.byte_budget >= 0 else -1

    def size_path(self):
        """Which marginal-bytes kernel the current sizes select:
        ``"uniform"`` (popcount), ``"per_word"`` (weighted popcount) or
        ``"per_expert"`` (per-bit sum)."""
        if self.uniform_bytes >= 0:
            return "uniform"
        return "per_word" if self.word_uniform else "per_expert"

    # ---------------------------------------------------------------- state views
    def seqs(self):
        return np.asarray(self.seq)[: self.size]

    def weights(self):
        return np.asarray(self.weight)[: self.size]

    def deficits(self):
        return self.a_deficit[: self.size]

    def credit_laps(self):
        return np.asarray(self.credit_lap)[: self.size]

    def pending_tokens(self):
        return self.a_tokens[: self.size]

    def demand_bits(self, Py_ssize_t index):
        if index < 0 or index >= self.size:
            raise IndexError(index)
        return np.asarray(self.bits[index])

    # ---------------------------------------------------------------- step
    def step(self):
        """Run one step; returns the batch size. Read the results with the
        ``result_*`` accessors (views valid until the next mutation)."""
        cdef Py_ssize_t k
        self._check_idle()
        self.busy = True
        try:
            with nogil:
                k = self._step()
        finally:
            self.busy = False
        return k

    cdef Py_ssize_t _step(self) noexcept nogil:
        cdef Py_ssize_t n = self.size
        cdef Py_ssize_t W = self.num_words
        cdef Py_ssize_t i, j, c, w, start, lo, hi, mid, num_cand, head
        cdef Py_ssize_t batch = 0
        cdef int64_t T = self.token_budget
        cdef int64_t M = self.byte_budget
        cdef bint bounded = M >= 0
        cdef int64_t tokens_left = T
        cdef int64_t bytes_left = M
        cdef int64_t lap = self.lap
        cdef int64_t grant, marginal, limit, soft_max, worth
        cdef int64_t F = self.fixed_bytes
        cdef bint marginal_rule = bounded and F >= 0
        cdef double cost, byte_cost, q, head_cost = 0.0
        cdef bint progressed, credit_limited_fit, continuing, stopped = False
        cdef const uint64_t* x
        cdef uint64_t* cov = &self.covered[0]
        cdef uint64_t* uni = &self.union_bits[0]
        cdef const uint64_t* res = &self.resident[0]
        cdef const int64_t* eb = &self.expert_bytes[0]
        cdef int64_t uniform = self.uniform_bytes
        cdef const int64_t* wbytes = &self.word_bytes[0]
        cdef bint word_uniform = self.word_uniform
        cdef int64_t* seq = &self.seq[0]
        cdef double* D = &self.deficit[0]
        cdef double* wt = &self.weight[0]
        cdef int64_t* clap = &self.credit_lap[0]
        cdef int64_t* tok = &self.tokens[0]
        cdef int64_t* cand = &self.candidates[0]
        cdef int64_t* lower = &self.cand_lower[0]
        cdef int64_t* used_at = &self.cand_used_at[0]
        cdef int64_t bytes_used = 0
        cdef uint8_t* done = &self.served[0]
        cdef double* quanta = &self.quanta[0]
        cdef int64_t cap = self.max_requests
        cdef uint64_t m

        self.batch_size = 0
        self.oversize = False
        self.cap_reached = False
        self.passes = 0
        self.examined = 0
        self.violation = 0
        memset(quanta, 0, n * sizeof(double))
        memset(uni, 0, W * sizeof(uint64_t))

        # NOTE: the scan starts at the first live request whose arrival seq is
        # >= the saved cursor (wrapping), so a removed cursor request passes
        # the turn to its successor and the ring order persists across steps.
        lo = 0
        hi = n
        while lo < hi:
            mid = (lo + hi) >> 1
            if seq[mid] < self.cursor_seq:
                lo = mid + 1
            else:
                hi = mid
        start = lo if lo < n else 0
        num_cand = 0
        for j in range(n):
            i = start + j
            if i >= n:
                i -= n
            if tok[i] > 0:
                cand[num_cand] = i
                lower[num_cand] = -1
                num_cand += 1
                done[i] = 0
        if num_cand == 0:
            self._finish_union(0)
            return 0

        head = cand[0]
        # the head continues its visit only if the cursor still names it
        continuing = self.visit_open and seq[head] == self.cursor_seq
        memcpy(cov, res, W * sizeof(uint64_t))
        while True:
            progressed = False
            credit_limited_fit = False
            self.passes += 1
            for c in range(num_cand):
                i = cand[c]
                if done[i]:
                    continue
                if cap > 0 and batch >= cap:
                    self.cap_reached = True
                    stopped = True
                    break
                if tokens_left == 0:
                    stopped = True
                    break
                x = &self.bits[i, 0]
                self.examined += 1
                grant = tok[i] if tok[i] < tokens_left else tokens_left
                # NOTE: only a candidate that could join a non-empty batch
                # needs its exact cost; one that cannot fit may stop counting
                # as soon as its bytes exceed the residual budget.
                if bounded and batch > 0:
                    # the largest marginal bytes the item may have and join:
                    # the bytes left, or under the marginal rule the most that
                    # still raises the step's modelled rate,
                    # g * (F + B) > tokens * mb  <=>  mb <= (g * (F + B) - 1) // tokens
                    # (normal items only, mb <= M)
                    limit = bytes_left
                    worth = 0
                    if marginal_rule:
                        worth = grant * (F + bytes_used)
                        soft_max = (worth - 1) // (T - tokens_left) if worth > 0 else -1
                        if soft_max > M:
                            soft_max = M
                        if soft_max > limit:
                            limit = soft_max
                    if limit < 0:
                        continue  # even mb = 0 would neither fit nor raise the rate
                    # NOTE: cheap exact skip. Within a step a candidate's
                    # marginal bytes can only fall by the bytes the batch has
                    # covered since it was last measured, so if a lower bound
                    # minus that still exceeds the limit, it cannot join now
                    # (the reference measures it and reaches the same verdict).
                    if lower[c] >= 0 and lower[c] - (bytes_used - used_at[c]) > limit:
                        continue
                    marginal = _marginal_bytes(x, cov, W, eb, uniform, wbytes, word_uniform, limit)
                    lower[c] = marginal
                    used_at[c] = bytes_used
                    if marginal > bytes_left and not (
                        marginal_rule and marginal <= M
                        and worth > (T - tokens_left) * marginal
                    ):
                        continue
                else:
                    marginal = _marginal_bytes(x, cov, W, eb, uniform, wbytes, word_uniform, -1)
                cost = <double>grant / <double>T
                if bounded:
                    byte_cost = <double>marginal / <double>M
                    if byte_cost > cost:
                        cost = byte_cost
                # NOTE: at most one quantum per request per lap (DRR), and only
                # for the current lap: quanta of laps it was not credited in
                # are not banked, so no request can draw a burst of old quanta
                # (the liveness proof bounds what a request can spend between
                # two lap openings by one quantum). Only while it cannot pay,
                # so D < c + w*Q still holds.
                if D[i] < cost and clap[i] < lap:
                    q = wt[i] * self.quantum
                    D[i] += q
                    quanta[i] += q
                    clap[i] = lap
                if D[i] < cost:
                    credit_limited_fit = True
                    continue
                D[i] -= cost
                done[i] = 1
                if i == head:
                    head_cost = cost
                self.out_index[batch] = i
                self.out_requested[batch] = tok[i]
                self.out_grant[batch] = grant
                self.out_marginal[batch] = marginal
                self.out_cost[batch] = cost
                batch += 1
                for w in range(W):
                    m = x[w]
                    uni[w] |= m & ~cov[w]
                    cov[w] |= m
                tokens_left -= grant
                if bounded:
                    bytes_left -= marginal
                    bytes_used += marginal
                progressed = True
                if bounded and marginal > M:
                    # the documented oversize exception: it runs alone, or
                    # under the marginal rule with only the items that rule
                    # admits (the bytes left are now negative)
                    self.oversize = True
                    if not marginal_rule:
                        stopped = True
                        break
            if stopped:
                break
            if progressed:
                continue
            if credit_limited_fit:
                # NOTE: work conservation: an item fits but its request is
                # out of credit, so a new DRR lap starts (each request gets at
                # most one quantum per lap, which is what keeps it fair).
                lap += 1
                continue
            break

        # consume the served demands; move the cursor
        for j in range(batch):
            tok[self.out_index[j]] = 0
        self.lap = lap
        i = head
        if done[i] and D[i] >= head_cost and not (continuing and quanta[i] > 0):
            # NOTE: DRR visit continuation: the head was served (anywhere in
            # the batch) and can still pay for another item like it, so the
            # next step starts at it again. A quantum during a continued
            # visit ends the visit (the head would otherwise be refilled by
            # every lap the others open and keep the head for ever).
            self.cursor_seq = seq[i]
            self.visit_open = True
        elif not done[i] and not continuing:
            # the head waits for credit; it keeps the head position
            self.cursor_seq = seq[i]
            self.visit_open = False
        else:
            # the head's turn is over: the first unserved candidate after it,
            # or, if everyone was served, the head's ring successor (so the
            # head role, which pays for bytes the others then share, rotates)
            self.visit_open = False
            self.cursor_seq = seq[i] + 1
            for c in range(1, num_cand):
                if not done[cand[c]]:
                    self.cursor_seq = seq[cand[c]]
                    break
        self.batch_size = batch
        self._finish_union(batch)
        self.violation = self._self_check(num_cand)
        return batch

    cdef int _self_check(self, Py_ssize_t num_cand) noexcept nogil:
        """vLLM-style end-of-step checks, O(batch + live) in C; the codes are
        explained by ``VIOLATIONS``. The from-scratch checks live in tests."""
        cdef Py_ssize_t j, k = self.batch_size
        cdef int64_t tokens = 0, nbytes = 0, g
        if num_cand > 0 and k == 0:
            return 1
        if self.max_requests > 0 and k > self.max_requests:
            return 2
        for j in range(k):
            g = self.out_grant[j]
            if g < 1 or g > self.out_requested[j]:
                return 3
            tokens += g
            nbytes += self.out_marginal[j]
        if tokens > self.token_budget:
            return 4
        if self.byte_budget >= 0 and nbytes > self.byte_budget and not (self.oversize and k == 1):
            # only the marginal rule may pass M: every item beyond the bytes
            # left is normal and raised the modelled rate of the batch before it
            if self.fixed_bytes < 0:
                return 5
            tokens = 0
            nbytes = 0
            for j in range(k):
                g = self.out_marginal[j]
                if j > 0 and nbytes + g > self.byte_budget and not (
                    g <= self.byte_budget
                    and self.out_grant[j] * (self.fixed_bytes + nbytes) > tokens * g
                ):
                    return 5
                tokens += self.out_grant[j]
                nbytes += g
        for j in range(self.size):
            if self.deficit[j] < 0:
                return 6
        for j in range(k):
            # served flags are per-step scratch: 1 = served; mark 2 on first sight
            if self.served[self.out_index[j]] != 1:
                return 7
            self.served[self.out_index[j]] = 2
        return 0

    cdef void _finish_union(self, Py_ssize_t batch) noexcept nogil:
        cdef Py_ssize_t w, k = 0
        cdef int64_t g
        cdef uint64_t m
        cdef uint64_t* uni = &self.union_bits[0]
        cdef uint8_t* mask = &self.union_mask[0]
        cdef int64_t* ids = &self.union_ids[0]
        memset(mask, 0, self.num_flat)
        if batch:
            for w in range(self.num_words):
                m = uni[w]
                while m:
                    g = (w << 6) + ctz64(m)
                    ids[k] = g
                    mask[g] = 1
                    k += 1
                    m &= m - 1
        self.union_size = k

    # ---------------------------------------------------------------- results
    def result_index(self):
        return self.a_out_index[: self.batch_size]

    def result_requested(self):
        return self.a_out_requested[: self.batch_size]

    def result_grant(self):
        return self.a_out_grant[: self.batch_size]

    def result_marginal(self):
        return self.a_out_marginal[: self.batch_size]

    def result_cost(self):
        return self.a_out_cost[: self.batch_size]

    def result_quanta(self):
        return self.a_quanta[: self.size]

    def result_union_ids(self):
        return self.a_union_ids[: self.union_size]

    def result_union_mask(self):
        return self.a_union_mask

    def results(self):
        """All of the last step's results in one call (views): batch indices,
        requested tokens, grants, marginal bytes, costs, union ids, union
        mask, then deficits and quanta of every live request."""
        cdef Py_ssize_t k = self.batch_size
        cdef Py_ssize_t n = self.size
        return (
            self.a_out_index[:k],
            self.a_out_requested[:k],
            self.a_out_grant[:k],
            self.a_out_marginal[:k],
            self.a_out_cost[:k],
            self.a_union_ids[: self.union_size],
            self.a_union_mask,
            self.a_deficit[:n],
            self.a_quanta[:n],
        )
