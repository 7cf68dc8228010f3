/*
 * Consecutive fused calls on a symmetric buffer (docs/fused.md), for spin
 * (models/check_fused_calls.sh runs it): who may write a rank's route tables and counts, and when.
 *
 * Two ranks run the same NCALLS calls: batch, streamed, batch, batch. A rank's tables and counts of
 * the routes from source s (src_index, recv_count) are abstracted to one word, counts[owner][s],
 * holding the call whose counts it has (its index + 1). A batch call's send units write them into
 * every owner (count_and_scatter, send_counts), then arrive at the barrier's epoch + 1; its readers
 * (the tables' build, the pulls) wait for every rank there. A streamed call's route units write the
 * owner's own word for each source once that source's producers have published the call (a source's
 * producers run after its previous call, in stream order); nothing arrives at epoch + 1. A rank
 * reads each source's word (its first CTA's build), arrives at epoch + 2 (its L2 tiles done); if it
 * has tokens, its combine units wait for every rank there. A CTA that started late builds its tables
 * only at its first claim, after all that: a second read. The last CTA arrives at epoch + 3, the
 * call's end. The assertion: every read sees the reading call's own counts. Not modeled: a broken
 * call (it does not arrive at its end), the staged schedule's send (it waits as a batch call's does).
 *
 * Calls with no tokens: RANK0_EMPTY and RANK1_EMPTY, bit n set for call n.
 * Mutants (check_fused_calls.sh requires each to be rejected):
 *   MUTANT_SENDS_DONT_WAIT   a batch call's sends write into the peers at once, without waiting for
 *                            every rank's previous call to end (the code before this model)
 *   MUTANT_WAIT_FOR_L2_ONLY  they wait for every rank's L2 tiles of the previous call (epoch + 2)
 *                            instead of its end: a late CTA's build can still read the next call's
 *                            counts
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
#define BASE(n) (3 * (n))

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
#if defined(MUTANT_WAIT_FOR_L2_ONLY)
        if
        :: n > 0 -> wait_all(BASE(n) - 1)
        :: else -> skip
        fi;
#elif !defined(MUTANT_SENDS_DONT_WAIT)
        wait_all(BASE(n));
#endif
        /* send units: this rank's counts into every owner, then epoch + 1 */
        counts[0 * NR + r] = n + 1;
        counts[1 * NR + r] = n + 1;
        arrived[r] = BASE(n) + 1;
        wait_all(BASE(n) + 1)
     fi;
     read_counts(r, n);
     arrived[r] = BASE(n) + 2;
     if
     :: EMPTY(r, n) -> skip
     :: else -> wait_all(BASE(n) + 2)  /* the combine units */
     fi;
     read_counts(r, n);  /* a CTA that started late */
     arrived[r] = BASE(n) + 3;
     n++
  od
}

init {
  atomic {
    run rank(0);
    run rank(1)
  }
}
