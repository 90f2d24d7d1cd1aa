// C++ side of the simulation harness (ctpu_tb_top.sv): imem, HBM and the result buffers.
//
// The cocotb bench (device_sim/rtl/cocotb_harness.py) runs in the same process and reaches these
// buffers through ctypes (the simulator binary is linked with -rdynamic), so loading a program and a
// 16 MiB HBM image, or reading back the final state, costs a memcpy instead of per-word VPI calls.
#include <cstdint>
#include <cstring>
#include <vector>

#include "svdpi.h"

#ifdef CTPU_WAVES
// Waveform builds dump through $dumpfile/$dumpvars in ctpu_tb_top; Verilator needs tracing enabled before
// the model is built (cocotb's main only does that in VM_TRACE builds), so do it at program start.
#include "verilated.h"
namespace {
struct EnableTracing {
    EnableTracing() { Verilated::traceEverOn(true); }
} g_enable_tracing;
}  // namespace
#endif

namespace {
std::vector<uint8_t> g_hbm;
std::vector<uint32_t> g_imem;  // 9 slot words per bundle
uint32_t g_prog_len = 0;
uint64_t g_max_cycles = 100000000ULL;
int g_trace = 0;
std::vector<uint32_t> g_args(32);  // launch arguments (sreg values on release)
std::vector<uint32_t> g_sregs(32);
std::vector<uint32_t> g_vregs;
std::vector<uint32_t> g_vmem;
std::vector<uint64_t> g_stats(32);
// trace records: [kind(0 issue, 1 sreg, 2 vreg), cycle lo, cycle hi, index, nwords, words...]
std::vector<uint32_t> g_trace_buf;
int g_vreg_words = 0;
int g_row_words = 0;
}  // namespace

extern "C" {

// ---- ctypes API (Python) ----
void ctpu_tb_init(uint64_t hbm_bytes, uint32_t imem_bundles, uint32_t vmem_rows, uint32_t lanes) {
    g_hbm.assign(hbm_bytes, 0);
    g_imem.assign(static_cast<size_t>(imem_bundles) * 9, 0);
    g_row_words = static_cast<int>(lanes);
    g_vreg_words = static_cast<int>(8 * lanes);
    g_vregs.assign(32 * g_vreg_words, 0);
    g_vmem.assign(static_cast<size_t>(vmem_rows) * lanes, 0);
}
void* ctpu_tb_hbm() { return g_hbm.data(); }
void* ctpu_tb_imem() { return g_imem.data(); }
void* ctpu_tb_sregs() { return g_sregs.data(); }
void* ctpu_tb_vregs() { return g_vregs.data(); }
void* ctpu_tb_vmem() { return g_vmem.data(); }
void* ctpu_tb_stats() { return g_stats.data(); }
void ctpu_tb_set_run(uint32_t prog_len, uint64_t max_cycles, int trace) {
    g_prog_len = prog_len;
    g_max_cycles = max_cycles;
    g_trace = trace;
    g_trace_buf.clear();
    std::fill(g_stats.begin(), g_stats.end(), 0);
}
void* ctpu_tb_args() { return g_args.data(); }
void* ctpu_tb_trace() { return g_trace_buf.data(); }
uint64_t ctpu_tb_trace_words() { return g_trace_buf.size(); }

// ---- DPI (SystemVerilog) ----
unsigned int ctpu_prog_len() { return g_prog_len; }
unsigned long long ctpu_max_cycles() { return g_max_cycles; }
int ctpu_trace_enabled() { return g_trace; }
unsigned int ctpu_arg(int idx) { return g_args[idx]; }
unsigned int ctpu_imem_word(unsigned int pc, int slot) {
    size_t i = static_cast<size_t>(pc) * 9 + slot;
    return i < g_imem.size() ? g_imem[i] : 0;
}
// Rows are at most LANES * 4 bytes; the core has checked the bounds at issue.
void ctpu_hbm_read(unsigned int addr, int nbytes, svBitVecVal* data) {
    std::memset(data, 0, static_cast<size_t>(g_row_words) * 4);
    if (static_cast<uint64_t>(addr) + nbytes <= g_hbm.size()) std::memcpy(data, &g_hbm[addr], nbytes);
}
void ctpu_hbm_write(unsigned int addr, int nbytes, const svBitVecVal* data) {
    if (static_cast<uint64_t>(addr) + nbytes <= g_hbm.size()) std::memcpy(&g_hbm[addr], data, nbytes);
}
void ctpu_dump_sreg(int idx, unsigned int value) { g_sregs[idx] = value; }
void ctpu_dump_vreg(int idx, const svBitVecVal* value) {
    std::memcpy(&g_vregs[static_cast<size_t>(idx) * g_vreg_words], value, g_vreg_words * 4);
}
void ctpu_dump_vmem(int row, const svBitVecVal* value) {
    std::memcpy(&g_vmem[static_cast<size_t>(row) * g_row_words], value, g_row_words * 4);
}
void ctpu_dump_stat(int idx, unsigned long long value) { g_stats[idx] = value; }

static void trace_head(uint32_t kind, unsigned long long cycle, uint32_t idx, uint32_t nwords) {
    g_trace_buf.push_back(kind);
    g_trace_buf.push_back(static_cast<uint32_t>(cycle));
    g_trace_buf.push_back(static_cast<uint32_t>(cycle >> 32));
    g_trace_buf.push_back(idx);
    g_trace_buf.push_back(nwords);
}
void ctpu_trace_issue(unsigned long long cycle, unsigned int pc) { trace_head(0, cycle, pc, 0); }
void ctpu_trace_sreg(unsigned long long cycle, int idx, unsigned int value) {
    trace_head(1, cycle, idx, 1);
    g_trace_buf.push_back(value);
}
void ctpu_trace_vreg(unsigned long long cycle, int idx, const svBitVecVal* value) {
    trace_head(2, cycle, idx, g_vreg_words);
    g_trace_buf.insert(g_trace_buf.end(), value, value + g_vreg_words);
}
}
