/*
 * Consecutive fused calls on a symmetric buffer (docs/fused.md), for spin
 * (models/check_fused_calls.sh runs it): who may write a rank's route tables and counts, and when.
 *
 * Two ranks run the same NCALLS calls: batch, streamed, batch, batch. A rank's tables and counts of the
 * routes from source s (src_index, recv_count) are abstracted to one word, counts[owner][s], holding
 * the call whose counts it has (its index + 1). A batch call's send units write them into every
 * owner at the call's start (count_and_scatter, send_counts) and arrive at the barrier's epoch + 1;
 * its readers (the tables' build, the pulls) wait for every rank there. A streamed call's route
 * units write the owner's own word for each source once that source's producers have published the
 * call (a source's producers run after its previous call, in stream order); nothing arrives at
 * epoch + 1. Either way a rank reads each source's word, then arrives at epoch + 2 (its last L2
 * tile, or its build when it has none); its combine units wait for every rank there, and a rank
 * without tokens has none. The assertion: every read sees the reading call's own counts.
 *
 * Calls with no tokens: RANK0_EMPTY and RANK1_EMPTY, bit n set for call n. (An empty batch call followed
 * by a streamed one cannot go wrong this way: a streamed call writes only its own rank's words.)
 * Mutants (check_fused_calls.sh requires each to be rejected):
 *   MUTANT_EMPTY_RANK_LEAVES_EARLY  a call without tokens ends without waiting at epoch + 2
 *                                   (the code before d75f665)
 *   MUTANT_READ_AFTER_ARRIVAL       a rank reads its counts after its arrival at epoch + 2: a
 *                                   reader must come before it (docs/experiments.md, Stop 71)
 */

#define NR 2
#define NCALLS 4
#ifndef RANK0_EMPTY
#define RANK0_EMPTY 0
#endif
#ifndef RANK1_EMPTY
#define RANK1_EMPTY 0
#endif

#define STREAMED(n) ((n) == 1)
#define EMPTY(r, n) ((((r) == 0 -> RANK0_EMPTY : RANK1_EMPTY) >> (n)) & 1)
#define BASE(n) (2 * (n))

byte counts[NR * NR];   /* [owner][source]: the call (+ 1) whose counts the word holds */
byte arrived[NR];       /* the epoch each rank has reached (rank_arrive; waits read >=) */
byte published[NR];     /* the calls (+ 1) whose chunks a source's producers have published */

inline wait_all(epoch) {
  (arrived[0] >= epoch && arrived[1] >= epoch)
}

inline read_counts(r, n) {
  assert(counts[r * NR + 0] == n + 1);
  assert(counts[r * NR + 1] == n + 1);
}

proctype rank(byte r) {
  byte n = 0;
  do
  :: n == NCALLS -> break
  :: n < NCALLS ->
     if
     :: STREAMED(n) ->
        published[r] = n + 1;  /* this rank's producers, after its previous call */
        /* route units, one per source, in any order: the owner's own word */
        if
        :: published[0] >= n + 1; counts[r * NR + 0] = n + 1; published[1] >= n + 1; counts[r * NR + 1] = n + 1
        :: published[1] >= n + 1; counts[r * NR + 1] = n + 1; published[0] >= n + 1; counts[r * NR + 0] = n + 1
        fi
     :: else ->
        /* send units: this rank's counts into every owner, then epoch + 1 */
        counts[0 * NR + r] = n + 1;
        counts[1 * NR + r] = n + 1;
        arrived[r] = BASE(n) + 1;
        wait_all(BASE(n) + 1)
     fi;
#ifndef MUTANT_READ_AFTER_ARRIVAL
     read_counts(r, n);
     arrived[r] = BASE(n) + 2;
#else
     arrived[r] = BASE(n) + 2;
     read_counts(r, n);
#endif
#ifdef MUTANT_EMPTY_RANK_LEAVES_EARLY
     if
     :: EMPTY(r, n) -> skip
     :: else -> wait_all(BASE(n) + 2)
     fi;
#else
     /* the combine units' wait, or the last CTA's on a rank without tokens */
     wait_all(BASE(n) + 2);
#endif
     n++
  od
}

init {
  atomic {
    run rank(0);
    run rank(1)
  }
}
