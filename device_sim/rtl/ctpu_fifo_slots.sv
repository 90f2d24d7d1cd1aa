// Occupancy of an in-order command FIFO of DEPTH entries, from the start cycles of its commands.
//
// A command holds its entry from issue until it starts (docs/architecture.md). Start cycles are
// non-decreasing, so the FIFO is full at cycle c exactly when the oldest of the last DEPTH commands has
// not started yet (start > c); a bundle issuing into it stalls until that command starts.
`default_nettype none

module ctpu_fifo_slots #(
  parameter int DEPTH = 8,
  localparam int PW = (DEPTH > 1) ? $clog2(DEPTH) : 1
) (
  input  wire logic        clk,
  input  wire logic        rst_n,
  input  wire logic [63:0] cycle_i,
  input  wire logic        push_i,
  input  wire logic [63:0] start_i,
  output logic             full_o
);
  logic [63:0]      start_q [DEPTH];
  logic [DEPTH-1:0] valid_q;
  logic [PW-1:0]    wp_q;

  assign full_o = valid_q[wp_q] && start_q[wp_q] > cycle_i;

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      valid_q <= '0;
      wp_q <= '0;
      for (int i = 0; i < DEPTH; i++) start_q[i] <= '0;
    end else if (push_i) begin
      start_q[wp_q] <= start_i;
      valid_q[wp_q] <= 1'b1;
      wp_q <= (32'(wp_q) == DEPTH - 1) ? '0 : wp_q + 1'b1;
    end
  end
endmodule

`default_nettype wire
