// One vector ALU slot (v0 or v1): every vector instruction of the table on SUBLANES x LANES lanes.
//
// Exposed latencies (isa.py): an ALU/conversion/select/broadcast/iota result is computed at the end of
// the issue cycle t into res_q and written to the vreg file at the end of t+1 (visible at t+2 =
// LAT_VALU); a cross-lane reduction, an exp, a reciprocal or a division (the exp and reciprocal units:
// ctpu_isa_pkg::fp32_exp, fp32_rcp, fp32_div on every lane) is computed at the end of t and travels
// red_q[0..2], written at the end of t+3 (visible at t+4 = LAT_XLANE). The arithmetic sits inside
// `if (issue_i)`: a datapath whose result register is enabled only on issue, which also means Verilator
// evaluates it only then.
`default_nettype none

module ctpu_valu
  import ctpu_isa_pkg::*;
  import ctpu_fp_pkg::*;
#(
  parameter int LANES = 8,
  localparam int W = SUBLANES * LANES * 32
) (
  input  wire logic           clk,
  input  wire logic           rst_n,
  input  wire logic           issue_i,
  input  wire logic [7:0]     op_i,
  input  wire logic [4:0]     d_i,
  input  wire logic [1:0]     iota_mode_i,
  input  wire logic [W-1:0]   va_i,
  input  wire logic [W-1:0]   vb_i,
  input  wire logic [W-1:0]   vc_i,
  input  wire logic [31:0]    s_i,      // vbcast's scalar
  // LAT_VALU write port
  output logic                we_o,
  output logic [4:0]          widx_o,
  output logic [W-1:0]        wdata_o,
  // LAT_XLANE write port
  output logic                red_we_o,
  output logic [4:0]          red_widx_o,
  output logic [W-1:0]        red_wdata_o,
  // the reduction that lands two cycles after this one (for write-conflict detection at issue)
  output logic                red_land2_o,
  output logic [4:0]          red_land2_idx_o
);
  localparam int NW = SUBLANES * LANES;

  logic          res_v_q;
  logic [4:0]    res_d_q;
  logic [W-1:0]  res_q;
  logic [2:0]    red_v_q;
  logic [4:0]    red_d_q [3];
  logic [W-1:0]  red_q [3];

  // the exp and reciprocal units (vexp.f, vrcp.f, vdiv.f) on every lane
  function automatic logic [W-1:0] unit_lanes(input logic [7:0] op, input logic [W-1:0] va,
                                               input logic [W-1:0] vb);
    logic [W-1:0] out;
    for (int i = 0; i < NW; i++)
      out[i*32 +: 32] = (op == OP_VEXP_F) ? fp32_exp(va[i*32 +: 32])
                      : (op == OP_VRCP_F) ? fp32_rcp(va[i*32 +: 32]) : fp32_div(va[i*32 +: 32], vb[i*32 +: 32]);
    return out;
  endfunction

  function automatic logic is_unit_op(input logic [7:0] op);
    return op == OP_VEXP_F || op == OP_VRCP_F || op == OP_VDIV_F;
  endfunction

  function automatic logic [31:0] lane_op(input logic [7:0] op, input logic [31:0] a, input logic [31:0] b,
                                          input logic [31:0] c);
    case (op)
      OP_VADD_F:    return fp32_add(a, b);
      OP_VSUB_F:    return fp32_sub(a, b);
      OP_VMUL_F:    return fp32_mul(a, b);
      OP_VMAX_F:    return fp32_max(a, b);
      OP_VMIN_F:    return fp32_min(a, b);
      OP_VCMP_EQ_F: return fp32_eq(a, b) ? 32'hffffffff : 32'd0;
      OP_VCMP_LT_F: return fp32_lt(a, b) ? 32'hffffffff : 32'd0;
      OP_VCMP_LE_F: return (fp32_lt(a, b) || fp32_eq(a, b)) ? 32'hffffffff : 32'd0;
      OP_VADD_I:    return a + b;
      OP_VSUB_I:    return a - b;
      OP_VMUL_I:    return a * b;
      OP_VAND:      return a & b;
      OP_VOR:       return a | b;
      OP_VXOR:      return a ^ b;
      OP_VSHL:      return a << b[4:0];
      OP_VSHR:      return a >> b[4:0];
      OP_VSRA:      return 32'($signed(a) >>> b[4:0]);
      OP_VCMP_EQ_I: return (a == b) ? 32'hffffffff : 32'd0;
      OP_VCMP_LT_I: return ($signed(a) < $signed(b)) ? 32'hffffffff : 32'd0;
      OP_VMOV:      return a;
      OP_VCVT_F2I:  return fp32_to_i32(a);
      OP_VCVT_I2F:  return i32_to_fp32(a);
      OP_VCVT_BF:   return fp32_round_bf(a);
      OP_VSEL:      return (a != 32'd0) ? b : c;
      default:      return 32'd0;
    endcase
  endfunction

  // Pairwise-halves tree (docs/architecture.md): x[i] = op(x[i], x[i + w/2]) for i < w/2, w /= 2.
  function automatic logic [W-1:0] reduce(input logic [7:0] op, input logic [W-1:0] va);
    logic [31:0] x [NW];
    logic [W-1:0] out;
    logic is_max, along_lanes;
    int width, stride, count;
    is_max = (op == OP_VRED_MAX_L || op == OP_VRED_MAX_S);
    along_lanes = (op == OP_VRED_SUM_L || op == OP_VRED_MAX_L);
    for (int i = 0; i < NW; i++) x[i] = va[i*32 +: 32];
    // a group is a row (along lanes: stride 1) or a column (along sublanes: stride LANES)
    width = along_lanes ? LANES : SUBLANES;
    stride = along_lanes ? 1 : LANES;
    count = along_lanes ? SUBLANES : LANES;
    for (int g = 0; g < count; g++) begin
      int base, w;
      base = along_lanes ? g * LANES : g;
      w = width;
      while (w > 1) begin
        for (int i = 0; i < w / 2; i++) begin
          x[base + i*stride] = is_max ? fp32_max(x[base + i*stride], x[base + (i + w/2)*stride])
                                      : fp32_add(x[base + i*stride], x[base + (i + w/2)*stride]);
        end
        w = w / 2;
      end
    end
    for (int i = 0; i < NW; i++) begin
      out[i*32 +: 32] = along_lanes ? x[(i / LANES) * LANES] : x[i % LANES];
    end
    return out;
  endfunction

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      res_v_q <= 1'b0;
      res_d_q <= '0;
      res_q <= '0;
      red_v_q <= '0;
      for (int i = 0; i < 3; i++) begin
        red_d_q[i] <= '0;
        red_q[i] <= '0;
      end
    end else begin
      res_v_q <= 1'b0;
      red_v_q <= {red_v_q[1:0], 1'b0};
      red_d_q[1] <= red_d_q[0];
      red_d_q[2] <= red_d_q[1];
      red_q[1] <= red_q[0];
      red_q[2] <= red_q[1];
      if (issue_i && op_i != OP_VEXT) begin  // vext writes an sreg: the core's vext pipeline
        if (op_latency(op_i) == LAT_XLANE) begin  // the long pipeline: the reductions, the exp and reciprocal units
          red_v_q[0] <= 1'b1;
          red_d_q[0] <= d_i;
          red_q[0] <= is_unit_op(op_i) ? unit_lanes(op_i, va_i, vb_i) : reduce(op_i, va_i);
        end else begin
          res_v_q <= 1'b1;
          res_d_q <= d_i;
          for (int i = 0; i < NW; i++) begin
            case (op_i)
              OP_VBCAST: res_q[i*32 +: 32] <= s_i;
              OP_VIOTA: res_q[i*32 +: 32] <= (iota_mode_i == 2'd0) ? 32'(i % LANES)
                                            : (iota_mode_i == 2'd1) ? 32'(i / LANES) : 32'(i);
              default: res_q[i*32 +: 32] <= lane_op(op_i, va_i[i*32 +: 32], vb_i[i*32 +: 32], vc_i[i*32 +: 32]);
            endcase
          end
        end
      end
    end
  end

  assign we_o = res_v_q;
  assign widx_o = res_d_q;
  assign wdata_o = res_q;
  assign red_we_o = red_v_q[2];
  assign red_widx_o = red_d_q[2];
  assign red_wdata_o = red_q[2];
  // A reduction in stage 1 during cycle c was issued at c - 2 and lands at c + 2: exactly when a LAT_VALU
  // result issued at c lands, so the core checks these for write conflicts.
  assign red_land2_o = red_v_q[1];
  assign red_land2_idx_o = red_d_q[1];
endmodule

`default_nettype wire
