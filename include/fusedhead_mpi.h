/*
 * fusedhead_mpi: the parallel heads of fusedhead_parallel.h over MPI communicators (libfusedhead_mpi, which links
 * libfusedhead: link both). This module makes layouts whose collectives are MPI's; the heads, the layout's
 * parameters and everything they do are fusedhead_parallel.h's, which says what every call communicates and
 * returns. The fh_mpi_* names below are fusedhead_parallel.h's calls under the names this module had before they
 * moved into libfusedhead: fh_mpi_ce_forward(ctx, layout, ...) is fh_parallel_ce_forward(ctx, layout, ...).
 *
 * MPI must be initialised by the caller, with at least MPI_THREAD_FUNNELED when contexts use more than one thread
 * (only the calling thread makes MPI calls). Communicators are given as vocab_comm and data_comm (the "vocab" and
 * "data" groups of fusedhead_parallel.h).
 */
#ifndef FUSEDHEAD_MPI_H
#define FUSEDHEAD_MPI_H

#include <mpi.h>

#include "fusedhead_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(FH_BUILDING_MPI_LIBRARY)
#define FH_MPI_API __attribute__((visibility("default")))
#else
#define FH_MPI_API
#endif

typedef fh_parallel_layout fh_mpi_layout;

/* Collective over vocab_comm, then data_comm. Either may be MPI_COMM_NULL (or MPI_COMM_SELF): no
 * parallelism of that kind. Both are duplicated (the caller's communicators may be freed afterwards).
 * local_vocab: this rank's shard size (>= 1); the shard's offset is the sum of the sizes of the lower
 * ranks of vocab_comm. Ranks of data_comm must hold the same shard (else FH_ERR_MPI_LAYOUT). With both
 * communicators, they must form a grid: every data_comm is made of one rank of each vocab_comm. A NULL
 * layout or a local_vocab < 1 on any rank fails every rank (FH_ERR_NULL_POINTER, FH_ERR_INVALID_SIZE). Made by
 * fh_parallel_layout_create over the duplicates, whose collectives are MPI's; fh_mpi_layout_destroy frees them
 * (collective: MPI_Comm_free). */
FH_MPI_API fh_status fh_mpi_layout_create(MPI_Comm vocab_comm, MPI_Comm data_comm, int64_t local_vocab,
                                          fh_mpi_layout **layout);

/* Convenience: splits comm into a grid of vocab_ranks-wide vocab communicators (consecutive ranks, as
 * Megatron's tensor-parallel groups) and size/vocab_ranks-wide data communicators (FH_ERR_MPI_LAYOUT if
 * vocab_ranks does not divide the size, or differs across the ranks). Collective over comm; a NULL layout on
 * any rank fails every rank. */
FH_MPI_API fh_status fh_mpi_layout_create_grid(MPI_Comm comm, int vocab_ranks, int64_t local_vocab,
                                               fh_mpi_layout **layout);

/* fh_mpi_layout_create with the communicators' Fortran handles (MPI_Comm_c2f; mpi4py's Comm.py2f()): an integer
 * whatever the MPI's C handle type, so that callers without MPI's C header (Python's ctypes) can pass them. */
FH_MPI_API fh_status fh_mpi_layout_create_fortran(MPI_Fint vocab_comm, MPI_Fint data_comm, int64_t local_vocab,
                                                  fh_mpi_layout **layout);

/* The rest under the module's names (fusedhead_parallel.h documents them). */
typedef fh_parallel_layout_info fh_mpi_layout_info;
typedef fh_parallel_param fh_mpi_param;
typedef fh_parallel_stats_collective fh_mpi_stats_collective;
typedef fh_parallel_reduction fh_mpi_reduction;
#define FH_MPI_PARAM_STATS_COLLECTIVE FH_PARALLEL_PARAM_STATS_COLLECTIVE
#define FH_MPI_PARAM_DX_REDUCTION FH_PARALLEL_PARAM_DX_REDUCTION
#define FH_MPI_PARAM_DWEIGHT_REDUCTION FH_PARALLEL_PARAM_DWEIGHT_REDUCTION
#define FH_MPI_STATS_PACKED FH_PARALLEL_STATS_PACKED
#define FH_MPI_STATS_MAX_THEN_SUM FH_PARALLEL_STATS_MAX_THEN_SUM
#define FH_MPI_ALLREDUCE FH_PARALLEL_ALLREDUCE
#define FH_MPI_REDUCE_SCATTER FH_PARALLEL_REDUCE_SCATTER
#define FH_MPI_NO_REDUCTION FH_PARALLEL_NO_REDUCTION
#define fh_mpi_layout_destroy fh_parallel_layout_destroy
#define fh_mpi_layout_query fh_parallel_layout_query
#define fh_mpi_layout_set fh_parallel_layout_set
#define fh_mpi_layout_get fh_parallel_layout_get
#define fh_mpi_dx_rows fh_parallel_dx_rows
#define fh_mpi_dweight_part fh_parallel_dweight_part
#define fh_mpi_ce_forward fh_parallel_ce_forward
#define fh_mpi_ce_backward fh_parallel_ce_backward
#define fh_mpi_ce_forward_backward fh_parallel_ce_forward_backward
#define fh_mpi_logprob_forward fh_parallel_logprob_forward
#define fh_mpi_logprob_backward fh_parallel_logprob_backward
#define fh_mpi_logprob_forward_backward fh_parallel_logprob_forward_backward
#define fh_mpi_logprob_support_forward fh_parallel_logprob_support_forward
#define fh_mpi_logprob_support_backward fh_parallel_logprob_support_backward
#define fh_mpi_logprob_support_forward_backward fh_parallel_logprob_support_forward_backward
#define fh_mpi_grpo_forward fh_parallel_grpo_forward
#define fh_mpi_grpo_backward fh_parallel_grpo_backward
#define fh_mpi_grpo_forward_backward fh_parallel_grpo_forward_backward
#define fh_mpi_kto_forward fh_parallel_kto_forward
#define fh_mpi_kto_forward_backward fh_parallel_kto_forward_backward

#ifdef __cplusplus
}
#endif
#endif
