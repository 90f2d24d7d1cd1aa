// The DMA engine: one channel between HBM and vmem with an in-order command FIFO.
//
// Timing (docs/architecture.md, "DMA"): at issue the scheduler computes
//   start = max(t, previous start, channel_free), xfer = rows * sum_q ceil(valid_bytes_q / BPC),
//   channel_free = start + xfer, done = start + xfer + LATENCY,
// which is exactly when an in-order FIFO whose head waits for a free channel would start it. The command
// then waits in the queue until its start cycle, and the engine moves one vmem row per
// ceil(valid_bytes / BPC) cycles. Loads: HBM read request in the row's cycle, vmem written one cycle later
// (the HBM port answers on the next clock); every load write lands by start + xfer < done. Stores read the
// vmem row in the row's cycle and write HBM at its end. The flag completes at `done` (done_o, to the
// core's flag scoreboard).
`default_nettype none

module ctpu_dma
  import ctpu_isa_pkg::*;
  import ctpu_fp_pkg::*;
#(
  parameter int LANES = 8,
  parameter int VMEM_ROWS = 4096,
  parameter longint HBM_BYTES = 64'd16777216,
  parameter int BPC = 32,           // HBM bytes per cycle (a power of two)
  parameter int LATENCY = 32,
  parameter int QUEUE = 8,
  localparam int AW = $clog2(VMEM_ROWS),
  localparam int ROWW = LANES * 32,
  localparam int QW = (QUEUE > 1) ? $clog2(QUEUE) : 1
) (
  input  wire logic            clk,
  input  wire logic            rst_n,
  input  wire logic [63:0]     cycle_i,
  // issue (the core raises issue_i only when trap_o is clear and the FIFO is not full)
  input  wire logic            check_i,      // a DMA instruction is in the bundle being considered
  input  wire logic            issue_i,
  input  wire logic            store_i,
  input  wire logic            bf16_i,
  input  wire logic [31:0]     hbm_i,
  input  wire logic [31:0]     vrow_i,
  input  wire logic [31:0]     shape_i,
  input  wire logic [31:0]     stride_i,
  output logic                 trap_o,
  output logic [3:0]           trap_code_o,
  output logic                 full_o,
  output logic [63:0]          done_o,
  // vmem port
  output logic [AW-1:0]        vmem_raddr_o,
  input  wire logic [ROWW-1:0] vmem_rdata_i,
  output logic                 vmem_we_o,
  output logic [AW-1:0]        vmem_waddr_o,
  output logic [ROWW-1:0]      vmem_wdata_o,
  // HBM port: a read returns on the next clock; a write is performed at the end of the cycle
  output logic                 hbm_re_o,
  output logic [31:0]          hbm_raddr_o,
  output logic [15:0]          hbm_rbytes_o,
  input  wire logic [ROWW-1:0] hbm_rdata_i,
  output logic                 hbm_we_o,
  output logic [31:0]          hbm_waddr_o,
  output logic [15:0]          hbm_wbytes_o,
  output logic [ROWW-1:0]      hbm_wdata_o,
  // statistics
  output logic [63:0]          commands_o,
  output logic [63:0]          bytes_loaded_o,
  output logic [63:0]          bytes_stored_o
);
  localparam int LOG_LANES = $clog2(LANES);
  localparam int LOG_BPC = $clog2(BPC);

  typedef struct packed {
    logic [63:0] start;
    logic        store;
    logic        bf16;
    logic [31:0] hbm;
    logic [31:0] vrow;
    logic [15:0] rows;
    logic [15:0] cols;
    logic [31:0] stride;
    logic [15:0] pitch;  // vmem rows per block row: ceil(cols / LANES)
  } cmd_t;

  // ---- issue-time checks and schedule (combinational) ----
  logic [15:0] rows, cols, pitch;
  logic [63:0] esize, last, xfer, start, chunk;
  logic [63:0] last_start_q, chan_free_q;

  function automatic logic [63:0] row_cost(input logic [63:0] bytes);
    return (bytes + 64'(BPC - 1)) >> LOG_BPC;
  endfunction

  always_comb begin
    rows = shape_i[31:16];
    cols = shape_i[15:0];
    esize = bf16_i ? 64'd2 : 64'd4;
    pitch = 16'((32'(cols) + 32'(LANES - 1)) >> LOG_LANES);
    last = 64'(hbm_i) + ((64'(rows) - 64'd1) * 64'(stride_i) + 64'(cols)) * esize;
    trap_code_o = TRAP_NONE;
    // same order as the simulator's checks (async_units.Dma.copy)
    if (rows == 16'd0 || cols == 16'd0) trap_code_o = TRAP_ZERO_SHAPE;
    else if ((64'(hbm_i) & (esize - 64'd1)) != 64'd0) trap_code_o = TRAP_MISALIGNED;
    // a store whose HBM rows overlap would make the result depend on the row order
    else if (store_i && rows > 16'd1 && stride_i < 32'(cols)) trap_code_o = TRAP_STORE_OVERLAP;
    else if (last > 64'(HBM_BYTES)) trap_code_o = TRAP_HBM_OOB;
    else if (vrow_i[31] || 64'(vrow_i) + 64'(rows) * 64'(pitch) > 64'(VMEM_ROWS)) trap_code_o = TRAP_VMEM_OOB;
    trap_o = check_i && trap_code_o != TRAP_NONE;
    // full vmem rows cost ceil(LANES * esize / BPC); the last one of a block row its valid bytes
    chunk = (64'(pitch) - 64'd1) * row_cost(64'(LANES) * esize)
          + row_cost((64'(cols) - (64'(pitch) - 64'd1) * 64'(LANES)) * esize);
    xfer = 64'(rows) * chunk;
    start = cycle_i;
    if (last_start_q > start) start = last_start_q;
    if (chan_free_q > start) start = chan_free_q;
    done_o = start + xfer + 64'(LATENCY);
  end

  ctpu_fifo_slots #(.DEPTH(QUEUE)) u_slots (
    .clk    (clk),
    .rst_n  (rst_n),
    .cycle_i(cycle_i),
    .push_i (issue_i),
    .start_i(start),
    .full_o (full_o)
  );

  // ---- the command queue ----
  cmd_t        q_q [QUEUE];
  logic [QW:0] count_q;
  logic [QW-1:0] rp_q, wp_q;
  logic        pop;
  cmd_t        head, incoming;
  logic        bypass;  // a command that starts in its own issue cycle skips the queue

  assign incoming = '{start: start, store: store_i, bf16: bf16_i, hbm: hbm_i, vrow: vrow_i, rows: rows,
                      cols: cols, stride: stride_i, pitch: pitch};
  assign bypass = issue_i && count_q == '0 && start == cycle_i;
  assign head = (count_q == '0) ? incoming : q_q[rp_q];
  assign pop = (count_q != '0 && head.start == cycle_i) || bypass;

  // ---- the engine ----
  cmd_t        act_q;
  logic        act_v_q;
  logic [15:0] r_q, p_q;
  logic [31:0] vrow_q;
  logic [63:0] wait_q;
  // a load row in flight: HBM data arrives next cycle, then vmem is written
  logic        ld_v_q, ld_bf16_q;
  logic [AW-1:0] ld_row_q;
  logic [15:0] ld_nv_q;

  cmd_t        cur;
  logic        do_row;
  logic [15:0] cur_r, cur_p, nv;
  logic [31:0] cur_vrow;
  logic [63:0] j0, row_bytes;
  /* verilator lint_off UNUSEDSIGNAL */  // the issue check keeps every address below HBM_BYTES <= 2^32
  logic [63:0] row_addr;
  /* verilator lint_on UNUSEDSIGNAL */
  logic        last_row;
  logic [ROWW-1:0] st_row;  // the vmem row a store sends this cycle

  always_comb begin
    cur = pop ? head : act_q;
    cur_r = pop ? 16'd0 : r_q;
    cur_p = pop ? 16'd0 : p_q;
    cur_vrow = pop ? head.vrow : vrow_q;
    do_row = pop || (act_v_q && wait_q == 64'd0);
    j0 = 64'(cur_p) << LOG_LANES;
    nv = (64'(cur.cols) - j0 >= 64'(LANES)) ? 16'(LANES) : 16'(64'(cur.cols) - j0);
    row_bytes = 64'(nv) * (cur.bf16 ? 64'd2 : 64'd4);
    row_addr = 64'(cur.hbm) + (64'(cur_r) * 64'(cur.stride) + j0) * (cur.bf16 ? 64'd2 : 64'd4);
    last_row = (cur_r == cur.rows - 16'd1) && (cur_p == cur.pitch - 16'd1);

    hbm_re_o = do_row && !cur.store;
    hbm_raddr_o = row_addr[31:0];
    hbm_rbytes_o = row_bytes[15:0];
    vmem_raddr_o = AW'(cur_vrow);
    // the load row whose HBM data arrived this cycle: widen bf16 exactly, zero-fill past cols
    vmem_we_o = ld_v_q;
    vmem_waddr_o = ld_row_q;
    vmem_wdata_o = '0;
    if (ld_v_q) begin
      for (int l = 0; l < LANES; l++) begin
        if (16'(l) < ld_nv_q) begin
          vmem_wdata_o[l*32 +: 32] = ld_bf16_q ? {hbm_rdata_i[l*16 +: 16], 16'd0} : hbm_rdata_i[l*32 +: 32];
        end
      end
    end

    // A store that starts as the previous load's last row is being written reads that row now: forward it
    // (DMA commands are ordered among themselves, so a store sees every earlier load's data).
    st_row = (vmem_we_o && vmem_waddr_o == vmem_raddr_o) ? vmem_wdata_o : vmem_rdata_i;
    hbm_we_o = do_row && cur.store;
    hbm_waddr_o = row_addr[31:0];
    hbm_wbytes_o = row_bytes[15:0];
    hbm_wdata_o = '0;
    if (do_row && cur.store) begin
      for (int l = 0; l < LANES; l++) begin
        if (cur.bf16) hbm_wdata_o[l*16 +: 16] = fp32_to_bf16(st_row[l*32 +: 32]);
        else hbm_wdata_o[l*32 +: 32] = st_row[l*32 +: 32];
      end
    end
  end

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      last_start_q <= '0;
      chan_free_q <= '0;
      count_q <= '0;
      rp_q <= '0;
      wp_q <= '0;
      for (int i = 0; i < QUEUE; i++) q_q[i] <= '0;
      act_q <= '0;
      act_v_q <= 1'b0;
      r_q <= '0;
      p_q <= '0;
      vrow_q <= '0;
      wait_q <= '0;
      ld_v_q <= 1'b0;
      ld_bf16_q <= 1'b0;
      ld_row_q <= '0;
      ld_nv_q <= '0;
      commands_o <= '0;
      bytes_loaded_o <= '0;
      bytes_stored_o <= '0;
    end else begin
      // issue: schedule and enqueue
      if (issue_i) begin
        last_start_q <= start;
        chan_free_q <= start + xfer;
        if (!bypass) begin
          q_q[wp_q] <= incoming;
          wp_q <= (32'(wp_q) == QUEUE - 1) ? '0 : wp_q + 1'b1;
        end
        commands_o <= commands_o + 64'd1;
        if (store_i) bytes_stored_o <= bytes_stored_o + 64'(rows) * 64'(cols) * esize;
        else bytes_loaded_o <= bytes_loaded_o + 64'(rows) * 64'(cols) * esize;
      end
      if (pop && !bypass) rp_q <= (32'(rp_q) == QUEUE - 1) ? '0 : rp_q + 1'b1;
      count_q <= count_q + (QW+1)'(issue_i && !bypass) - (QW+1)'(pop && !bypass);

      // engine
      ld_v_q <= do_row && !cur.store;
      if (do_row) begin
        act_q <= cur;
        act_v_q <= !last_row;
        wait_q <= row_cost(row_bytes) - 64'd1;
        ld_bf16_q <= cur.bf16;
        ld_row_q <= AW'(cur_vrow);
        ld_nv_q <= nv;
        vrow_q <= cur_vrow + 32'd1;
        if (cur_p == cur.pitch - 16'd1) begin
          p_q <= 16'd0;
          r_q <= cur_r + 16'd1;
        end else begin
          p_q <= cur_p + 16'd1;
          r_q <= cur_r;
        end
      end else if (act_v_q) begin
        wait_q <= wait_q - 64'd1;
      end
    end
  end
endmodule

`default_nettype wire
