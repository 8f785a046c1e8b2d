// The GGUF weight formats goose multiplies with, and the packed layout both quantized kernel libraries
// (quant_kernels.cpp: float32 arithmetic, int8_kernels.cpp: integer arithmetic) read. goose.backends.quant.FORMATS
// lists the same codes, GGUF block sizes and bytes for Python; tests/test_quant.py checks the two against each other.
#pragma once

namespace {

constexpr int kCols = 16;  // output columns per panel (goose.backends.quant.PANEL)

enum Fmt { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kFormats = 5 };

struct Info {
  int group;    // weights per group along K
  int header;   // header bytes per group (16 columns)
  int quants;   // quant bytes per group (16 columns)
  int block;    // GGUF block: weights
  int bbytes;   // GGUF block: bytes
};
constexpr Info kInfo[kFormats] = {
    {32, 32, 512, 32, 34},    // Q8_0
    {32, 32, 256, 32, 18},    // Q4_0
    {32, 64, 256, 32, 20},    // Q4_1
    {32, 128, 256, 256, 144}, // Q4_K
    {16, 64, 256, 256, 210},  // Q6_K
};

constexpr int group_bytes(int f) { return kInfo[f].header + kInfo[f].quants; }
constexpr bool nibbles(int f) { return f == kQ4_0 || f == kQ4_1 || f == kQ4_K; }  // two 4-bit quants per byte
constexpr bool has_offset(int f) { return f == kQ4_1 || f == kQ4_K; }             // w = s * q + o

}  // namespace
