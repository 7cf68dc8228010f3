/*
 * The streaming front-ring protocol of docs/streaming.md, for spin (models/check.sh runs it).
 *
 * Two ranks, each a source (its ring of NS slots, written by a route producer and a layout
 * producer) and a destination (a consumer that reads every source's chunks). NCALLS layer calls;
 * in each, every source publishes 1..MAXCH chunks, or one empty chunk when it has no tokens, the
 * last one flagged. Producers and consumers keep persistent sequence cursors, so slot s of a
 * source carries generations 1, 2, 3, ... across calls, as include/megamoe/streaming.h does.
 *
 * A payload half is abstracted to a tag naming the (call, chunk) whose data it holds. A read is
 * a window from the consumer's acquire to its acknowledgement; a write is one step (its first
 * store: a read window open at that moment overlaps it, a later read sees the new tag). The
 * assertions: a consumer reads exactly the chunk it expects, fully written (no read before both
 * ready generations match, no stale generation: no ABA), and no producer writes a slot while any
 * consumer's read window on it is open (no reuse before every acknowledgement). Waits are
 * blocking guards, so a deadlock is an invalid end state.
 *
 * Launch schedules (define at most one):
 *   (none)          producers and consumers run fully concurrently
 *   LATE_PRODUCER   a rank's producers start a call only after that rank's consumer has started it
 *   SERIALIZED      per rank, stream order without overlap: producers(n), then consumer(n), then
 *                   producers(n + 1): the MoE kernel is never launched early
 * Call plan: source 0 publishes MAXCH, 1 and 2 chunks (slot 0 sees generations 1, 2, 3);
 * RANK1_CALL0..2 give source 1's calls (0 = no tokens, else a chunk count).
 * Mutants (check.sh requires each to be rejected):
 *   MUTANT_SINGLE_ACK           a producer reuses a slot after its own rank's acknowledgement only
 *   MUTANT_COMBINED_READY       route and layout publish one combined ready word
 *   MUTANT_EARLY_ACK            a consumer acknowledges at its acquire, before its reads end
 *   MUTANT_REPLAYED_GENERATION  the consumer's expected generations restart every call, as if
 *                               taken from a kernel argument captured in a CUDA graph
 *   MAXCH=3 with SERIALIZED     a call with more chunks than the ring has slots
 */

#define NR 2
#define NS 2
#define NCALLS 3
#ifndef MAXCH
#define MAXCH 2
#endif
#ifndef RANK1_CALL0
#define RANK1_CALL0 0
#define RANK1_CALL1 0
#define RANK1_CALL2 0
#endif

#define SLOT(r, s) ((r) * NS + (s))
#define ACK(r, s, d) (((r) * NS + (s)) * NR + (d))
#define PLAN(r, n) ((r) * NCALLS + (n))
#define TAG(n, c) ((n) * MAXCH + (c) + 1)   /* 0: never written */

/* Ring state of every source rank. */
byte route_ready[NR * NS];
byte layout_ready[NR * NS];
byte consumed[NR * NS * NR];   /* [source][slot][destination] */
byte route_tag[NR * NS];       /* top-k ids, weights, metadata */
byte layout_tag[NR * NS];      /* x, x scales */
bool meta_last[NR * NS];
bool meta_empty[NR * NS];

#ifdef MUTANT_COMBINED_READY
#define LAYOUT_READY route_ready
#else
#define LAYOUT_READY layout_ready
#endif

/* Ghost: destination d is inside its read window on a slot. */
bool reading[NR * NS * NR];

/* The call plan. */
byte chunks[NR * NCALLS];
bool no_tokens[NR * NCALLS];

/* Launch bookkeeping: calls started or finished per role and rank. */
byte consumer_started[NR];
byte consumer_done[NR];
byte route_done[NR];
byte layout_done[NR];

inline producer_launch(r, n) {
#if defined(SERIALIZED)
  (consumer_done[r] == n)
#elif defined(LATE_PRODUCER)
  (consumer_started[r] > n)
#else
  skip
#endif
}

inline consumer_launch(d, n) {
#if defined(SERIALIZED)
  (route_done[d] > n && layout_done[d] > n)
#else
  skip
#endif
}

/* Slot s may take sequence seq (generation seq / NS + 1) once every destination acknowledged
   generation seq / NS. A destination's word cannot move past that value before this producer
   publishes again, so polling the words one by one is the same as this one guard (written out
   for NR = 2, as are the consumer's per-source choices below). */
#ifdef MUTANT_SINGLE_ACK
#define SLOT_FREE(r, s, seq) (consumed[ACK(r, s, r)] == (seq) / NS)
#else
#define SLOT_FREE(r, s, seq) (consumed[ACK(r, s, 0)] == (seq) / NS && consumed[ACK(r, s, 1)] == (seq) / NS)
#endif

inline assert_no_reader(r, s, d) {
  d = 0;
  do
  :: d < NR -> assert(!reading[ACK(r, s, d)]); d++
  :: else -> break
  od
}

/* One step per chunk: wait until the slot is free, write the route half (top-k ids, weights,
   metadata), publish route_ready with release. Writing and publishing are one step because no
   consumer may look at the payload before it sees the publish; one that does (a mutant) reads
   the old tag or is inside a read window, and an assertion fires either way. */
proctype RouteProducer(byte r) {
  byte n, c, s, d;
  byte seq = 0;
  for (n : 0 .. NCALLS - 1) {
    producer_launch(r, n);
    for (c : 0 .. chunks[PLAN(r, n)] - 1) {
      s = seq % NS;
      atomic {
        SLOT_FREE(r, s, seq) ->
        assert_no_reader(r, s, d);
        route_tag[SLOT(r, s)] = TAG(n, c);
        meta_last[SLOT(r, s)] = (c == chunks[PLAN(r, n)] - 1);
        meta_empty[SLOT(r, s)] = no_tokens[PLAN(r, n)];
        route_ready[SLOT(r, s)] = seq / NS + 1;   /* release */
        seq++;
        if
        :: meta_last[SLOT(r, s)] -> route_done[r] = n + 1
        :: else -> skip
        fi
      }
    }
  }
}

/* The same for the layout half (x and its scales); an empty chunk has no rows to write. */
proctype LayoutProducer(byte r) {
  byte n, c, s, d;
  byte seq = 0;
  for (n : 0 .. NCALLS - 1) {
    producer_launch(r, n);
    for (c : 0 .. chunks[PLAN(r, n)] - 1) {
      s = seq % NS;
      atomic {
        SLOT_FREE(r, s, seq) ->
        if
        :: !no_tokens[PLAN(r, n)] ->
           assert_no_reader(r, s, d);
           layout_tag[SLOT(r, s)] = TAG(n, c)
        :: else -> skip
        fi;
        LAYOUT_READY[SLOT(r, s)] = seq / NS + 1;   /* release */
        seq++;
        if
        :: c == chunks[PLAN(r, n)] - 1 -> layout_done[r] = n + 1
        :: else -> skip
        fi
      }
    }
  }
}

/* Picks a source with chunks left in this call, in any order. */
inline pick_source() {
  if
  :: !finished[0] -> r = 0
  :: !finished[1] -> r = 1
  fi;
  s = next_seq[r] % NS;
  g = next_seq[r] / NS + 1
}

/* Two steps per chunk: acquire both ready words and read (the read window opens), then close
   the window and release the acknowledgement. Neither ready word can move past g before this
   consumer acknowledges, so waiting on one and then the other is the same as one guard. */
proctype Consumer(byte d) {
  byte n, r, s, g;
  byte next_seq[NR];     /* persistent: the next sequence expected from each source */
  byte chunk_index[NR];  /* the next chunk of the current call, per source */
  bool finished[NR];
  byte remaining;
  for (n : 0 .. NCALLS - 1) {
    consumer_launch(d, n);
    atomic {
      consumer_started[d] = n + 1;
#ifdef MUTANT_REPLAYED_GENERATION
      next_seq[0] = 0; next_seq[1] = 0;
#endif
      chunk_index[0] = 0; chunk_index[1] = 0;
      finished[0] = false; finished[1] = false;
      remaining = NR;
      pick_source()
    };
    do
    :: remaining == 0 -> break
    :: else ->
       atomic {
         (route_ready[SLOT(r, s)] == g && LAYOUT_READY[SLOT(r, s)] == g) ->   /* acquire */
         reading[ACK(r, s, d)] = true;
#ifdef MUTANT_EARLY_ACK
         consumed[ACK(r, s, d)] = g;
#endif
         assert(route_tag[SLOT(r, s)] == TAG(n, chunk_index[r]));
         assert(meta_empty[SLOT(r, s)] || layout_tag[SLOT(r, s)] == TAG(n, chunk_index[r]));
         finished[r] = meta_last[SLOT(r, s)]
       };
       atomic {
         reading[ACK(r, s, d)] = false;
         consumed[ACK(r, s, d)] = g;   /* release, after the last read */
         next_seq[r]++;
         chunk_index[r]++;
         if
         :: finished[r] -> remaining--
         :: else -> skip
         fi;
         if
         :: remaining == 0 -> consumer_done[d] = n + 1; r = 0; s = 0; g = 0
         :: else -> pick_source()
         fi
       }
    od
  }
}

/* Plan of one (source, call): 0 = no tokens (one empty chunk), else that many chunks. */
inline plan_call(r, n, k) {
  chunks[PLAN(r, n)] = (k == 0 -> 1 : k);
  no_tokens[PLAN(r, n)] = (k == 0)
}

init {
  plan_call(0, 0, MAXCH); plan_call(0, 1, 1); plan_call(0, 2, 2);
  plan_call(1, 0, RANK1_CALL0); plan_call(1, 1, RANK1_CALL1); plan_call(1, 2, RANK1_CALL2);
  atomic {
    run RouteProducer(0); run LayoutProducer(0); run Consumer(0);
    run RouteProducer(1); run LayoutProducer(1); run Consumer(1)
  }
}
