// The vector unit: the vreg file (32 x SUBLANES x LANES x 32b), the two ALU slots, the vld pipeline and
// the vst read port.
//
// All slots of a bundle read the vreg file combinationally in the issue cycle t (before any write of that
// cycle, which happens at its end). Write ports, each landing at issue + latency:
//   v0, v1 ALU results (LAT_VALU), v0, v1 reductions, exps, reciprocals and divisions (LAT_XLANE), vld (LAT_VLOAD).
// Two results landing in one register in one cycle is a trap; since every latency is known at issue,
// `conflict_o` flags it, per slot, for the issuing bundle (the core then traps instead of issuing).
`default_nettype none

module ctpu_vector_unit
  import ctpu_isa_pkg::*;
#(
  parameter int LANES = 8,
  localparam int W = SUBLANES * LANES * 32,
  localparam int ROWW = LANES * 32
) (
  input  wire logic                 clk,
  input  wire logic                 rst_n,
  // the bundle being issued (valid only in its issue cycle)
  input  wire logic [1:0]           alu_issue_i,
  input  wire logic [1:0]           alu_used_i,     // the slot holds an instruction (issuing or not)
  input  wire logic [1:0][7:0]      alu_op_i,
  input  wire logic [1:0][4:0]      alu_d_i,
  input  wire logic [1:0][4:0]      alu_a_i,
  input  wire logic [1:0][4:0]      alu_b_i,
  input  wire logic [1:0][4:0]      alu_c_i,
  input  wire logic [1:0][1:0]      alu_iota_i,
  input  wire logic [1:0][31:0]     alu_s_i,        // scalar operand of vbcast (sreg[a])
  input  wire logic                 vld_issue_i,
  input  wire logic                 vld_used_i,
  input  wire logic                 vld_row_i,      // vld.row: broadcast one row
  input  wire logic [4:0]           vld_d_i,
  input  wire logic [SUBLANES-1:0][ROWW-1:0] vld_rows_i,  // vmem rows [addr, addr + SUBLANES)
  input  wire logic [4:0]           vst_d_i,
  output logic [W-1:0]              vst_data_o,     // vreg[vst_d_i], for vst
  output logic [1:0][W-1:0]         alu_va_o,       // vreg[a] of each ALU slot, for vext (vector -> sreg)
  // would the issuing bundle's writes collide with each other or with an in-flight reduction?
  input  wire logic                 check_i,
  output logic [2:0]                conflict_o,     // v0, v1, vld
  // monitor: the writes landing at the end of this cycle (for the per-bundle trace)
  output logic [4:0]                mon_we_o,
  output logic [4:0][4:0]           mon_idx_o,
  output logic [4:0][W-1:0]         mon_data_o
);
  logic [W-1:0] vregs_q [NUM_VREGS];

  logic [1:0]         we, red_we, land2;
  logic [1:0][4:0]    widx, red_widx, land2_idx;
  logic [W-1:0]       wdata [2];
  logic [W-1:0]       red_wdata [2];

  logic          vld_v_q;
  logic [4:0]    vld_d_q;
  logic [W-1:0]  vld_q;

  for (genvar k = 0; k < 2; k++) begin : g_alu
    ctpu_valu #(.LANES(LANES)) u_valu (
      .clk            (clk),
      .rst_n          (rst_n),
      .issue_i        (alu_issue_i[k]),
      .op_i           (alu_op_i[k]),
      .d_i            (alu_d_i[k]),
      .iota_mode_i    (alu_iota_i[k]),
      .va_i           (vregs_q[alu_a_i[k]]),
      .vb_i           (vregs_q[alu_b_i[k]]),
      .vc_i           (vregs_q[alu_c_i[k]]),
      .s_i            (alu_s_i[k]),
      .we_o           (we[k]),
      .widx_o         (widx[k]),
      .wdata_o        (wdata[k]),
      .red_we_o       (red_we[k]),
      .red_widx_o     (red_widx[k]),
      .red_wdata_o    (red_wdata[k]),
      .red_land2_o    (land2[k]),
      .red_land2_idx_o(land2_idx[k])
    );
  end

  assign vst_data_o = vregs_q[vst_d_i];
  assign alu_va_o = {vregs_q[alu_a_i[1]], vregs_q[alu_a_i[0]]};

  // ---- write-conflict check for the issuing bundle, per slot ----
  // The simulator executes v0, v1, then vld and the slot whose result would land second traps, so each
  // slot is checked against what lands before it in that order: reductions issued at t - 2 (land2),
  // then the earlier slots of this bundle.
  function automatic logic is_red(input logic [7:0] op);  // the long pipeline: reductions, exp and reciprocal units
    return op_latency(op) == LAT_XLANE;
  endfunction

  logic [1:0] lands2;  // ALU slot results landing at t + 2 (not reductions, not vext: that writes an sreg)
  always_comb begin
    for (int k = 0; k < 2; k++)
      lands2[k] = alu_used_i[k] && !is_red(alu_op_i[k]) && alu_op_i[k] != OP_VEXT;
  end

  function automatic logic hits_land2(input logic [4:0] d);
    return (land2[0] && land2_idx[0] == d) || (land2[1] && land2_idx[1] == d);
  endfunction

  always_comb begin
    conflict_o = '0;
    if (check_i) begin
      conflict_o[0] = lands2[0] && hits_land2(alu_d_i[0]);
      conflict_o[1] = (lands2[1] && (hits_land2(alu_d_i[1]) || (lands2[0] && alu_d_i[0] == alu_d_i[1])))
                   || (alu_used_i[0] && alu_used_i[1] && is_red(alu_op_i[0]) && is_red(alu_op_i[1])
                       && alu_d_i[0] == alu_d_i[1]);  // two reductions landing at t + 4
      conflict_o[2] = vld_used_i && (hits_land2(vld_d_i) || (lands2[0] && alu_d_i[0] == vld_d_i)
                                     || (lands2[1] && alu_d_i[1] == vld_d_i));
    end
  end

  // ---- vld pipeline: read at t, result register at the end of t, vreg written at the end of t+1 ----
  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      vld_v_q <= 1'b0;
      vld_d_q <= '0;
      vld_q <= '0;
    end else begin
      vld_v_q <= vld_issue_i;
      if (vld_issue_i) begin
        vld_d_q <= vld_d_i;
        for (int s = 0; s < SUBLANES; s++) vld_q[s*ROWW +: ROWW] <= vld_rows_i[vld_row_i ? 0 : s];
      end
    end
  end

  // ---- the vreg file: every port writes at the end of its landing cycle ----
  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      for (int r = 0; r < NUM_VREGS; r++) vregs_q[r] <= '0;
    end else begin
      if (we[0]) vregs_q[widx[0]] <= wdata[0];
      if (we[1]) vregs_q[widx[1]] <= wdata[1];
      if (red_we[0]) vregs_q[red_widx[0]] <= red_wdata[0];
      if (red_we[1]) vregs_q[red_widx[1]] <= red_wdata[1];
      if (vld_v_q) vregs_q[vld_d_q] <= vld_q;
    end
  end

  assign mon_we_o = {vld_v_q, red_we[1], red_we[0], we[1], we[0]};
  assign mon_idx_o = {vld_d_q, red_widx[1], red_widx[0], widx[1], widx[0]};
  assign mon_data_o = {vld_q, red_wdata[1], red_wdata[0], wdata[1], wdata[0]};
endmodule

`default_nettype wire
