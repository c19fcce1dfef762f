// The instruction-set prologue every CPU kernel file includes first (see paged_attention.cpp):
// PDSERVE_ISA 2 = AVX512, 1 = AVX2, 0 = portable. It opens a target region (a GCC pragma, and
// at::vec's CPU_CAPABILITY namespace) for the kernels that follow; each file closes it with
// PDSERVE_ISA_END before its ops, which stay baseline so that any build loads on any x86 CPU.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include "pool.h"
#ifndef PDSERVE_ISA
#define PDSERVE_ISA 0
#endif

#if PDSERVE_ISA == 2
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#elif PDSERVE_ISA == 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#else
#define CPU_CAPABILITY DEFAULT
#endif
// the pragma enables the instructions, not the macros the headers test for them
#if PDSERVE_ISA != 0 && !defined(__AVX2__)
#define __AVX2__ 1
#define __AVX__ 1
#define __FMA__ 1
#define __F16C__ 1
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if PDSERVE_ISA != 0
#define PDSERVE_ISA_END _Pragma("GCC pop_options")
#else
#define PDSERVE_ISA_END
#endif
