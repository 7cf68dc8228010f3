// Multi-rank test scenarios, each run once per rank by run_ranks (emulated ranks or processes). A
// scenario throws megamoe::Error naming the rank and the first thing that went wrong, so a failing
// run is understood from its log alone; run_ranks prints it as "rank R: ...".
#pragma once

#include "megamoe/comm.h"

namespace megamoe::comm_test {

// A small problem whose buffer holds every scenario's scratch data (in the x region).
Problem test_problem(const Communicator& comm);

// A buffer dirtied, freed, and created again reads zero on every rank, through every peer's address.
void buffer_zeroed(Communicator& comm);
// Rounds of: store into the next rank's buffer and into one's own, release a flag there; acquire the
// previous rank's flag, check its stores (local loads) and its own data (peer loads); acknowledge.
void peer_store_flag(Communicator& comm);
// 10,000 in-kernel rank barriers, each checking the mailboxes every rank wrote to every rank.
void rank_barrier_many(Communicator& comm);
// The standalone barrier kernel between separate writer and checker kernels, 100 times.
void standalone_barrier(Communicator& comm);
// 1,000 grid barriers over the rank's whole multiprocessor budget, each checking every block's slot.
void grid_barrier_many(Communicator& comm);
// Needs two or more ranks: rank 0's hidden differs; every rank must get the error naming it.
void fingerprint_mismatch(Communicator& comm);
// Needs two or more ranks: the last rank's problem is invalid; every rank must get the error.
void invalid_problem(Communicator& comm);
// Needs two or more ranks: the last rank never enters the barrier; the others must time out with a
// message naming it. Run with a short MEGAMOE_TIMEOUT_MS.
void rank_barrier_timeout(Communicator& comm);
// One block skips the grid barrier; the others must time out, and the barrier must work afterwards.
void grid_barrier_timeout(Communicator& comm);
// 100 buffers created and destroyed must leave the device's free memory where it was.
void create_destroy_many(Communicator& comm);
// Bulk (TMA) and vector pulls of 7392- and 14336-byte rows from the next rank copy exactly the rows.
void pull_rows(Communicator& comm);
// Two host threads launching bulk pulls of different row sizes at once, 500 times each: every
// launch must succeed (the kernel's shared-memory attribute is shared by the whole process).
void concurrent_pull_launches();

}  // namespace megamoe::comm_test
