// Simulation harness around ctpu_core (not synthesizable; the cocotb toplevel).
//
// The clock is generated here (Verilator --timing), so Python is not woken per cycle: the cocotb bench
// loads a program and an HBM image into the C++ model (ctpu_tb_dpi.cpp, through ctypes), pulses rst_n,
// and awaits `done`. imem and HBM live in C++ and are reached through DPI; at the end the final sregs,
// vregs, vmem and statistics are dumped to C++ buffers in one cycle, then `done` rises.
// With trace enabled, every issued bundle (cycle, pc) and every register write (landing cycle, register,
// value) is recorded, in the simulator's trace format, to locate the first mismatch.
`default_nettype none

module ctpu_tb_top
  import ctpu_isa_pkg::*;
#(
  parameter int LANES = CFG_SMALL_LANES,
  parameter int VMEM_ROWS = CFG_SMALL_VMEM_ROWS,
  parameter longint HBM_BYTES = 64'(CFG_SMALL_HBM_BYTES),
  parameter int BPC = CFG_SMALL_HBM_BYTES_PER_CYCLE,
  parameter int DMA_LATENCY = CFG_SMALL_DMA_LATENCY,
  parameter int DMA_QUEUE = CFG_SMALL_DMA_QUEUE,
  parameter int MXU_QUEUE = CFG_SMALL_MXU_QUEUE,
  parameter int IMEM_BUNDLES = CFG_SMALL_IMEM_BUNDLES
);
  localparam int ROWW = LANES * 32;
  localparam int VW = SUBLANES * LANES * 32;

  import "DPI-C" function int unsigned ctpu_prog_len();
  import "DPI-C" function longint unsigned ctpu_max_cycles();
  import "DPI-C" function int ctpu_trace_enabled();
  import "DPI-C" function int unsigned ctpu_arg(input int idx);
  import "DPI-C" function int unsigned ctpu_imem_word(input int unsigned pc, input int slot);
  import "DPI-C" function void ctpu_hbm_read(input int unsigned addr, input int nbytes,
                                             output bit [ROWW-1:0] data);
  import "DPI-C" function void ctpu_hbm_write(input int unsigned addr, input int nbytes,
                                              input bit [ROWW-1:0] data);
  import "DPI-C" function void ctpu_dump_sreg(input int idx, input int unsigned value);
  import "DPI-C" function void ctpu_dump_vreg(input int idx, input bit [VW-1:0] value);
  import "DPI-C" function void ctpu_dump_vmem(input int row, input bit [ROWW-1:0] value);
  import "DPI-C" function void ctpu_dump_stat(input int idx, input longint unsigned value);
  import "DPI-C" function void ctpu_trace_issue(input longint unsigned cycle, input int unsigned pc);
  import "DPI-C" function void ctpu_trace_sreg(input longint unsigned cycle, input int idx,
                                               input int unsigned value);
  import "DPI-C" function void ctpu_trace_vreg(input longint unsigned cycle, input int idx,
                                               input bit [VW-1:0] value);

  logic clk;
  // rst_n is both the core's asynchronous reset and this harness's synchronous "load imem" condition
  /* verilator lint_off SYNCASYNCNET */
  logic rst_n;  // driven by the cocotb bench
  /* verilator lint_on SYNCASYNCNET */
  logic done;   // awaited by the cocotb bench

  initial begin
    clk = 1'b0;
    rst_n = 1'b0;
    done = 1'b0;
  end
  always #1 clk = ~clk;

`ifdef CTPU_WAVES
  // waveform builds only (verilator_build.build(waves=True)): +ctpu_fst=<file> names the FST file
  initial begin
    string fst;
    if ($value$plusargs("ctpu_fst=%s", fst) == 0) fst = "ctpu_rtl.fst";
    $dumpfile(fst);
    $dumpvars(0, ctpu_tb_top);
  end
`endif

  // ---- imem: loaded from C++ while in reset ----
  logic [BUNDLE_BITS-1:0] imem [IMEM_BUNDLES];
  logic [31:0] prog_len;
  logic [63:0] max_cycles;
  logic        trace_en;
  logic [NUM_SREGS-1:0][31:0] args;  // launch arguments: the sreg file on release
  logic [31:0] imem_addr;
  logic [BUNDLE_BITS-1:0] bundle;

  always @(posedge clk) begin
    if (!rst_n) begin
      prog_len <= ctpu_prog_len();
      max_cycles <= ctpu_max_cycles();
      trace_en <= ctpu_trace_enabled() != 0;
      for (int r = 0; r < NUM_SREGS; r++) args[r] <= ctpu_arg(r);
      for (int pc = 0; pc < IMEM_BUNDLES; pc++) begin
        if (32'(pc) < ctpu_prog_len()) begin
          for (int s = 0; s < NUM_SLOTS; s++) imem[pc][s*32 +: 32] <= ctpu_imem_word(pc, s);
        end
      end
    end
  end
  // past the program (pc_end traps before decoding it), reads return nop bundles
  assign bundle = (imem_addr < prog_len && imem_addr < IMEM_BUNDLES) ? imem[imem_addr[$clog2(IMEM_BUNDLES)-1:0]]
                                                                     : '0;

  // ---- HBM through DPI: reads answer on the next clock, writes happen at the clock ----
  logic            hbm_re, hbm_we;
  logic [31:0]     hbm_raddr, hbm_waddr;
  logic [15:0]     hbm_rbytes, hbm_wbytes;
  logic [ROWW-1:0] hbm_rdata, hbm_wdata;
  bit   [ROWW-1:0] rd_tmp;

  always @(posedge clk) begin
    if (rst_n && hbm_re) begin
      ctpu_hbm_read(hbm_raddr, 32'(hbm_rbytes), rd_tmp);
      hbm_rdata <= rd_tmp;
    end
    if (rst_n && hbm_we) ctpu_hbm_write(hbm_waddr, 32'(hbm_wbytes), hbm_wdata);
  end

  // ---- the core ----
  logic core_done, trap;
  logic [3:0] trap_code;
  logic [31:0] trap_pc;
  logic [63:0] trap_cycle, cycles, bundles, mxu_busy, mxu_wl, dma_cmds, dma_ld, dma_st;
  logic [2:0][63:0] stalls;
  logic [NUM_SLOTS-1:0][63:0] slot_ops;
  logic mon_issue;
  logic [31:0] mon_pc;
  logic [63:0] mon_cycle;
  logic [3:0] mon_swe;
  logic [3:0][4:0] mon_sidx;
  logic [3:0][31:0] mon_sdata;
  logic [4:0] mon_vwe;
  logic [4:0][4:0] mon_vidx;
  logic [4:0][VW-1:0] mon_vdata;

  ctpu_core #(
    .LANES(LANES), .VMEM_ROWS(VMEM_ROWS), .HBM_BYTES(HBM_BYTES), .BPC(BPC), .DMA_LATENCY(DMA_LATENCY),
    .DMA_QUEUE(DMA_QUEUE), .MXU_QUEUE(MXU_QUEUE)
  ) u_core (
    .clk               (clk),
    .rst_n             (rst_n),
    .prog_len_i        (prog_len),
    .max_cycles_i      (max_cycles),
    .sreg_init_i       (args),
    .imem_addr_o       (imem_addr),
    .imem_bundle_i     (bundle),
    .hbm_re_o          (hbm_re),
    .hbm_raddr_o       (hbm_raddr),
    .hbm_rbytes_o      (hbm_rbytes),
    .hbm_rdata_i       (hbm_rdata),
    .hbm_we_o          (hbm_we),
    .hbm_waddr_o       (hbm_waddr),
    .hbm_wbytes_o      (hbm_wbytes),
    .hbm_wdata_o       (hbm_wdata),
    .done_o            (core_done),
    .trap_o            (trap),
    .trap_code_o       (trap_code),
    .trap_pc_o         (trap_pc),
    .trap_cycle_o      (trap_cycle),
    .cycles_o          (cycles),
    .bundles_o         (bundles),
    .stalls_o          (stalls),
    .slot_ops_o        (slot_ops),
    .mxu_busy_o        (mxu_busy),
    .mxu_weight_loads_o(mxu_wl),
    .dma_commands_o    (dma_cmds),
    .dma_bytes_loaded_o(dma_ld),
    .dma_bytes_stored_o(dma_st),
    .mon_issue_o       (mon_issue),
    .mon_pc_o          (mon_pc),
    .mon_cycle_o       (mon_cycle),
    .mon_swe_o         (mon_swe),
    .mon_sidx_o        (mon_sidx),
    .mon_sdata_o       (mon_sdata),
    .mon_vwe_o         (mon_vwe),
    .mon_vidx_o        (mon_vidx),
    .mon_vdata_o       (mon_vdata)
  );

  // ---- monitor: trace, then the final-state dump ----
  always @(posedge clk) begin
    if (!rst_n) begin
      done <= 1'b0;
    end else if (!done) begin
      if (trace_en) begin
        if (mon_issue) ctpu_trace_issue(mon_cycle, mon_pc);
        // writes performed at this edge land (become visible) in the next cycle
        for (int k = 0; k < 4; k++) if (mon_swe[k]) ctpu_trace_sreg(mon_cycle + 64'd1, 32'(mon_sidx[k]), mon_sdata[k]);
        for (int k = 0; k < 5; k++) if (mon_vwe[k]) ctpu_trace_vreg(mon_cycle + 64'd1, 32'(mon_vidx[k]), mon_vdata[k]);
      end
      if (core_done) begin
        for (int r = 0; r < NUM_SREGS; r++) ctpu_dump_sreg(r, u_core.sregs_q[r]);
        for (int r = 0; r < NUM_VREGS; r++) ctpu_dump_vreg(r, u_core.u_vector.vregs_q[r]);
        for (int r = 0; r < VMEM_ROWS; r++) ctpu_dump_vmem(r, u_core.u_vmem.mem_q[r]);
        ctpu_dump_stat(0, cycles);
        ctpu_dump_stat(1, bundles);
        ctpu_dump_stat(2, {63'd0, trap});
        ctpu_dump_stat(3, {60'd0, trap_code});
        ctpu_dump_stat(4, {32'd0, trap_pc});
        ctpu_dump_stat(5, trap_cycle);
        ctpu_dump_stat(6, stalls[0]);
        ctpu_dump_stat(7, stalls[1]);
        ctpu_dump_stat(8, stalls[2]);
        ctpu_dump_stat(9, mxu_busy);
        ctpu_dump_stat(10, mxu_wl);
        ctpu_dump_stat(11, dma_cmds);
        ctpu_dump_stat(12, dma_ld);
        ctpu_dump_stat(13, dma_st);
        for (int i = 0; i < NUM_SLOTS; i++) ctpu_dump_stat(16 + i, slot_ops[i]);
        done <= 1'b1;
      end
    end
  end
endmodule

`default_nettype wire
