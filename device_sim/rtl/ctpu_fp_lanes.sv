// Test wrapper: the fp32/bf16 functions of ctpu_fp_pkg (and the exp and reciprocal units') on LANES lanes at once
// (combinational), so a cocotb bench checks many operand pairs per Python call. Not part of the core.
`default_nettype none

module ctpu_fp_lanes #(
  parameter int LANES = 64
) (
  input  wire logic [3:0]            op_i,  // FP_OP_* below
  input  wire logic [LANES*32-1:0]   a_i,
  input  wire logic [LANES*32-1:0]   b_i,
  output logic      [LANES*32-1:0]   y_o
);
  import ctpu_fp_pkg::*;

  localparam logic [3:0] FP_OP_ADD = 4'd0;
  localparam logic [3:0] FP_OP_SUB = 4'd1;
  localparam logic [3:0] FP_OP_MUL = 4'd2;
  localparam logic [3:0] FP_OP_BF = 4'd3;  // round to bf16 precision (fp32 container)
  localparam logic [3:0] FP_OP_F2I = 4'd4;
  localparam logic [3:0] FP_OP_I2F = 4'd5;
  localparam logic [3:0] FP_OP_MAX = 4'd6;
  localparam logic [3:0] FP_OP_MIN = 4'd7;
  localparam logic [3:0] FP_OP_LT = 4'd8;
  localparam logic [3:0] FP_OP_EQ = 4'd9;
  localparam logic [3:0] FP_OP_BF16 = 4'd10;  // bf16 bits in [15:0]
  localparam logic [3:0] FP_OP_EXP = 4'd11;  // the exp unit (vexp.f)
  localparam logic [3:0] FP_OP_RCP = 4'd12;  // the reciprocal unit (vrcp.f)
  localparam logic [3:0] FP_OP_DIV = 4'd13;  // the reciprocal unit (vdiv.f)

  always_comb begin
    for (int l = 0; l < LANES; l++) begin
      logic [31:0] a, b, y;
      a = a_i[l*32 +: 32];
      b = b_i[l*32 +: 32];
      case (op_i)
        FP_OP_ADD: y = fp32_add(a, b);
        FP_OP_SUB: y = fp32_sub(a, b);
        FP_OP_MUL: y = fp32_mul(a, b);
        FP_OP_BF: y = fp32_round_bf(a);
        FP_OP_F2I: y = fp32_to_i32(a);
        FP_OP_I2F: y = i32_to_fp32(a);
        FP_OP_MAX: y = fp32_max(a, b);
        FP_OP_MIN: y = fp32_min(a, b);
        FP_OP_LT: y = {31'd0, fp32_lt(a, b)};
        FP_OP_EQ: y = {31'd0, fp32_eq(a, b)};
        FP_OP_BF16: y = {16'd0, fp32_to_bf16(a)};
        FP_OP_EXP: y = ctpu_isa_pkg::fp32_exp(a);
        FP_OP_RCP: y = ctpu_isa_pkg::fp32_rcp(a);
        FP_OP_DIV: y = ctpu_isa_pkg::fp32_div(a, b);
        default: y = 32'd0;
      endcase
      y_o[l*32 +: 32] = y;
    end
  end
endmodule

`default_nettype wire
