// One processing element of the weight-stationary systolic array.
//
// Holds two weights (bank 0 and 1: the active and shadow buffers; which one is active travels with each
// activation as xbank). An activation arrives from the left, is used with this PE's weight and passes on
// to the right one cycle later; the partial sum arrives from above and leaves downwards:
//   p_o = fl32(p_i + fl32(x * w[bank]))      (numerics contract: k ascending down the column)
// The arithmetic is enabled only when a valid activation passes.
`default_nettype none

module ctpu_mxu_pe
  import ctpu_fp_pkg::*;
(
  input  wire logic        clk,
  input  wire logic        rst_n,
  input  wire logic        xv_i,
  input  wire logic        xbank_i,
  input  wire logic [31:0] x_i,       // bf16 value in an fp32 container
  input  wire logic [31:0] p_i,
  input  wire logic        wv_i,      // weight write
  input  wire logic        wbank_i,
  input  wire logic [31:0] w_i,
  output logic             xv_o,
  output logic             xbank_o,
  output logic [31:0]      x_o,
  output logic [31:0]      p_o
);
  logic [31:0] w_q [2];

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      w_q[0] <= '0;
      w_q[1] <= '0;
      xv_o <= 1'b0;
      xbank_o <= 1'b0;
      x_o <= '0;
      p_o <= '0;
    end else begin
      if (wv_i) w_q[wbank_i] <= w_i;
      xv_o <= xv_i;
      if (xv_i) begin
        xbank_o <= xbank_i;
        x_o <= x_i;
        p_o <= fp32_add(p_i, fp32_mul(x_i, w_q[xbank_i]));
      end
    end
  end
endmodule

`default_nettype wire
