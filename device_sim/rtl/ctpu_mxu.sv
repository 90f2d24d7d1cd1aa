// The matrix unit: command scheduler, weight port, data port, output stage, and the systolic array.
//
// Timing (docs/architecture.md, "MXU"), computed at issue with `prev` the previous command's start:
//   mxu.lw/lwt/lwt.lo/lwt.hi: start = max(t, prev, weight_port_free, shadow_free); done = start + N;
//               weight_port_free = weights_ready = done
//   mxu.mm*:    start = max(t, prev, data_port_free, weights_ready if it swaps);
//               data_port_free = start + rows; done = start + rows + 2N; a swap sets shadow_free = start
// Commands wait in per-port queues until their start cycle (they start in program order, so this is the
// in-order FIFO; a weight load and an mm may start in the same cycle on their separate ports).
// The weight port then reads one vmem row per cycle for N cycles, the data port one activation row per
// cycle for `rows` cycles; each row's result reaches the output stage 2N cycles after it was read and is
// written (mma: added to the old row) at the end of that cycle, so the last lands exactly at `done`.
// Which weight bank is active is a bit flipped by each swapping mm when it starts; activations carry it.
`default_nettype none

module ctpu_mxu
  import ctpu_isa_pkg::*;
  import ctpu_fp_pkg::*;
#(
  parameter int N = 8,
  parameter int VMEM_ROWS = 4096,
  parameter int QUEUE = 4,
  localparam int AW = $clog2(VMEM_ROWS),
  localparam int ROWW = N * 32,
  localparam int QW = (QUEUE > 1) ? $clog2(QUEUE) : 1,
  localparam int IW = $clog2(N)
) (
  input  wire logic            clk,
  input  wire logic            rst_n,
  input  wire logic [63:0]     cycle_i,
  input  wire logic            check_i,
  input  wire logic            issue_i,
  input  wire logic [7:0]      op_i,
  input  wire logic [31:0]     sa_i,     // lw: weight rows; mm: input rows
  input  wire logic [31:0]     sb_i,     // mm: output rows
  input  wire logic [31:0]     sc_i,     // mm: row count
  output logic                 trap_o,
  output logic [3:0]           trap_code_o,
  output logic                 full_o,
  output logic [63:0]          done_o,
  // vmem ports
  output logic [AW-1:0]        w_addr_o,
  input  wire logic [ROWW-1:0] w_data_i,
  output logic [AW-1:0]        x_addr_o,
  input  wire logic [ROWW-1:0] x_data_i,
  output logic [AW-1:0]        o_addr_o,
  input  wire logic [ROWW-1:0] o_data_i,
  output logic                 o_we_o,
  output logic [ROWW-1:0]      o_wdata_o,
  // statistics
  output logic [63:0]          busy_cycles_o,
  output logic [63:0]          weight_loads_o
);
  localparam int MW = 2 * N;  // output-stage delay: array fill + drain

  // ---- issue-time checks and schedule ----
  logic is_lw, is_lwt, is_packed, is_load, is_acc, is_swap;
  logic [63:0] start, rows;
  logic [63:0] last_start_q, wport_free_q, shadow_free_q, wready_q, dport_free_q;

  function automatic logic span_bad(input logic [31:0] row, input logic [63:0] count);
    return row[31] || 64'(row) + count > 64'(VMEM_ROWS);
  endfunction

  always_comb begin
    is_lw = op_i == OP_MXU_LW;
    is_packed = op_i == OP_MXU_LWT_LO || op_i == OP_MXU_LWT_HI;
    is_lwt = op_i == OP_MXU_LWT || is_packed;
    is_load = is_lw || is_lwt;
    is_acc = op_i == OP_MXU_MMA || op_i == OP_MXU_MMAS;
    is_swap = op_i == OP_MXU_MMS || op_i == OP_MXU_MMAS;
    rows = 64'(sc_i);
    trap_code_o = TRAP_NONE;
    // same order as the simulator (async_units.Mxu)
    if (is_load) begin
      if (span_bad(sa_i, 64'(N))) trap_code_o = TRAP_VMEM_OOB;
    end else begin
      if (rows == 64'd0 || rows > 64'(VMEM_ROWS)) trap_code_o = TRAP_ZERO_SHAPE;
      else if (64'(sa_i) < 64'(sb_i) + rows && 64'(sb_i) < 64'(sa_i) + rows) trap_code_o = TRAP_MM_OVERLAP;
      else if (span_bad(sa_i, rows) || span_bad(sb_i, rows)) trap_code_o = TRAP_VMEM_OOB;
    end
    trap_o = check_i && trap_code_o != TRAP_NONE;
    start = cycle_i;
    if (last_start_q > start) start = last_start_q;
    if (is_load) begin
      if (wport_free_q > start) start = wport_free_q;
      if (shadow_free_q > start) start = shadow_free_q;
      done_o = start + 64'(N);
    end else begin
      if (dport_free_q > start) start = dport_free_q;
      if (is_swap && wready_q > start) start = wready_q;
      done_o = start + rows + 64'(MW);
    end
  end

  ctpu_fifo_slots #(.DEPTH(QUEUE)) u_slots (
    .clk    (clk),
    .rst_n  (rst_n),
    .cycle_i(cycle_i),
    .push_i (issue_i),
    .start_i(start),
    .full_o (full_o)
  );

  // ---- per-port command queues ----
  typedef struct packed {
    logic [63:0] start;
    logic [AW-1:0] addr;
    logic        t;
    logic        p;  // packed bf16 pairs (mxu.lwt.lo / .hi)
    logic        h;  // ... the high half of the row's words (.hi)
  } wcmd_t;
  typedef struct packed {
    logic [63:0] start;
    logic [AW-1:0] x;
    logic [AW-1:0] o;
    logic [31:0] rows;
    logic        acc;
    logic        swap;
  } dcmd_t;

  wcmd_t wq_q [QUEUE];
  dcmd_t dq_q [QUEUE];
  logic [QW:0] wcount_q, dcount_q;
  logic [QW-1:0] wrp_q, wwp_q, drp_q, dwp_q;
  logic wpop, dpop;
  wcmd_t whead, win_cmd;
  dcmd_t dhead, din_cmd;
  logic  wbypass, dbypass;  // a command that starts in its own issue cycle skips its queue

  assign win_cmd = '{start: start, addr: AW'(sa_i), t: is_lwt, p: is_packed, h: op_i == OP_MXU_LWT_HI};
  assign din_cmd = '{start: start, x: AW'(sa_i), o: AW'(sb_i), rows: sc_i, acc: is_acc, swap: is_swap};
  assign wbypass = issue_i && is_load && wcount_q == '0 && start == cycle_i;
  assign dbypass = issue_i && !is_load && dcount_q == '0 && start == cycle_i;
  assign whead = (wcount_q == '0) ? win_cmd : wq_q[wrp_q];
  assign dhead = (dcount_q == '0) ? din_cmd : dq_q[drp_q];
  assign wpop = (wcount_q != '0 && whead.start == cycle_i) || wbypass;
  assign dpop = (dcount_q != '0 && dhead.start == cycle_i) || dbypass;

  // ---- engines ----
  logic act_bank_q;                 // the bank mm rows use (flipped by swaps as they start)
  logic bank_now;                   // ... including a swap starting this cycle
  logic          wact_q, wt_q, wp_q, wh_q, wbank_q;
  logic [AW-1:0] waddr_q;
  logic [IW-1:0] wi_q;
  logic          dact_q, dacc_q, dbank_q;
  logic [AW-1:0] dx_q, do_q;
  logic [31:0]   dr_q, drows_q;

  logic          w_go, w_t, w_p, w_h, w_bank;
  logic [AW-1:0] w_row;
  logic [IW-1:0] w_i;
  logic          d_go, d_acc, d_bank;
  logic [AW-1:0] d_x, d_o;
  logic [31:0]   d_r, d_rows;

  // output-stage meta, aligned with the array's de-skewed output
  logic [MW-1:0]          mv_q, macc_q;
  logic [MW-1:0][AW-1:0]  mrow_q;
  logic [N-1:0][31:0]     xin, win, out;

  always_comb begin
    bank_now = act_bank_q ^ (dpop && dhead.swap);
    w_go = wpop || wact_q;
    w_t = wpop ? whead.t : wt_q;
    w_p = wpop ? whead.p : wp_q;
    w_h = wpop ? whead.h : wh_q;
    w_bank = wpop ? ~bank_now : wbank_q;  // a load fills the buffer that is not active
    w_i = wpop ? '0 : wi_q;
    w_row = AW'((wpop ? whead.addr : waddr_q) + AW'(w_i));
    d_go = dpop || dact_q;
    d_acc = dpop ? dhead.acc : dacc_q;
    d_bank = dpop ? bank_now : dbank_q;
    d_r = dpop ? 32'd0 : dr_q;
    d_rows = dpop ? dhead.rows : drows_q;
    d_x = AW'((dpop ? dhead.x : dx_q) + AW'(d_r));
    d_o = AW'((dpop ? dhead.o : do_q) + AW'(d_r));
    w_addr_o = w_row;
    x_addr_o = d_x;
    for (int l = 0; l < N; l++) begin
      // packed: weight l is bf16 half l % 2 (low first) of word l / 2 of the row's low or high N/2 words
      win[l] = !w_go ? 32'd0 : fp32_round_bf(!w_p ? w_data_i[l*32 +: 32]
                                             : {w_data_i[((w_h ? N / 2 : 0) + l / 2) * 32 + (l % 2) * 16 +: 16], 16'd0});
      xin[l] = d_go ? fp32_round_bf(x_data_i[l*32 +: 32]) : 32'd0;
    end
  end

  ctpu_mxu_array #(.N(N)) u_array (
    .clk       (clk),
    .rst_n     (rst_n),
    .xin_v_i   (d_go),
    .xin_bank_i(d_bank),
    .xin_i     (xin),
    .win_v_i   (w_go),
    .win_idx_i (w_i),
    .win_bank_i(w_bank),
    .win_t_i   (w_t),
    .win_i     (win),
    .out_o     (out)
  );

  // output stage: write the row (mma: fl32(old + p)) at the end of cycle s + r + 2N
  always_comb begin
    o_addr_o = mrow_q[MW-1];
    o_we_o = mv_q[MW-1];
    o_wdata_o = '0;
    if (mv_q[MW-1]) begin
      for (int l = 0; l < N; l++) begin
        o_wdata_o[l*32 +: 32] = macc_q[MW-1] ? fp32_add(o_data_i[l*32 +: 32], out[l]) : out[l];
      end
    end
  end

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      last_start_q <= '0;
      wport_free_q <= '0;
      shadow_free_q <= '0;
      wready_q <= '0;
      dport_free_q <= '0;
      for (int i = 0; i < QUEUE; i++) begin
        wq_q[i] <= '0;
        dq_q[i] <= '0;
      end
      wcount_q <= '0;
      dcount_q <= '0;
      wrp_q <= '0;
      wwp_q <= '0;
      drp_q <= '0;
      dwp_q <= '0;
      act_bank_q <= 1'b0;
      wact_q <= 1'b0;
      wt_q <= 1'b0;
      wp_q <= 1'b0;
      wh_q <= 1'b0;
      wbank_q <= 1'b0;
      waddr_q <= '0;
      wi_q <= '0;
      dact_q <= 1'b0;
      dacc_q <= 1'b0;
      dbank_q <= 1'b0;
      dx_q <= '0;
      do_q <= '0;
      dr_q <= '0;
      drows_q <= '0;
      mv_q <= '0;
      macc_q <= '0;
      mrow_q <= '0;
      busy_cycles_o <= '0;
      weight_loads_o <= '0;
    end else begin
      if (issue_i) begin
        last_start_q <= start;
        if (is_load) begin
          wport_free_q <= done_o;
          wready_q <= done_o;
          if (!wbypass) begin
            wq_q[wwp_q] <= win_cmd;
            wwp_q <= (32'(wwp_q) == QUEUE - 1) ? '0 : wwp_q + 1'b1;
          end
          weight_loads_o <= weight_loads_o + 64'd1;
        end else begin
          dport_free_q <= start + rows;
          if (is_swap) shadow_free_q <= start;
          if (!dbypass) begin
            dq_q[dwp_q] <= din_cmd;
            dwp_q <= (32'(dwp_q) == QUEUE - 1) ? '0 : dwp_q + 1'b1;
          end
          busy_cycles_o <= busy_cycles_o + rows;
        end
      end
      wcount_q <= wcount_q + (QW+1)'(issue_i && is_load && !wbypass) - (QW+1)'(wpop && !wbypass);
      dcount_q <= dcount_q + (QW+1)'(issue_i && !is_load && !dbypass) - (QW+1)'(dpop && !dbypass);
      if (wpop && !wbypass) wrp_q <= (32'(wrp_q) == QUEUE - 1) ? '0 : wrp_q + 1'b1;
      if (dpop && !dbypass) drp_q <= (32'(drp_q) == QUEUE - 1) ? '0 : drp_q + 1'b1;
      act_bank_q <= bank_now;

      // weight port: N rows, one per cycle
      if (w_go) begin
        wact_q <= 32'(w_i) != N - 1;
        wt_q <= w_t;
        wp_q <= w_p;
        wh_q <= w_h;
        wbank_q <= w_bank;
        waddr_q <= wpop ? whead.addr : waddr_q;
        wi_q <= w_i + 1'b1;
      end
      // data port: `rows` rows, one per cycle
      if (d_go) begin
        dact_q <= d_r != d_rows - 32'd1;
        dacc_q <= d_acc;
        dbank_q <= d_bank;
        dx_q <= dpop ? dhead.x : dx_q;
        do_q <= dpop ? dhead.o : do_q;
        dr_q <= d_r + 32'd1;
        drows_q <= d_rows;
      end
      mv_q <= {mv_q[MW-2:0], d_go};
      macc_q <= {macc_q[MW-2:0], d_acc};
      mrow_q <= {mrow_q[MW-2:0], d_o};
    end
  end
endmodule

`default_nettype wire
