// Vector memory: ROWS rows of LANES 32-bit words, zeroed at reset.
//
// Ports (reads are asynchronous, writes land at the end of the cycle):
//   vld reads SUBLANES consecutive rows, vst writes SUBLANES rows, the DMA engine reads/writes one row,
//   the MXU reads a weight row and an activation row and reads/writes one output row. Ports
//   never collide on race-free programs (docs/architecture.md,
//   "races"): the core traps on out-of-bounds addresses before they reach this module, so addresses here
//   wrap modulo ROWS.
// Zeroing at reset is a simulation convenience (every run starts from zeroed vmem, as the simulator's
// does); silicon would run an init sequence instead.
`default_nettype none

module ctpu_vmem
  import ctpu_isa_pkg::*;
#(
  parameter int LANES = 8,
  parameter int ROWS = 4096,
  localparam int AW = $clog2(ROWS),
  localparam int ROWW = LANES * 32
) (
  input  wire logic                           clk,
  input  wire logic                           rst_n,
  input  wire logic [AW-1:0]                  vld_addr_i,
  output logic [SUBLANES-1:0][ROWW-1:0]       vld_rows_o,
  input  wire logic                           vst_we_i,
  input  wire logic [AW-1:0]                  vst_addr_i,
  input  wire logic [SUBLANES-1:0][ROWW-1:0]  vst_rows_i,
  input  wire logic [AW-1:0]                  dma_raddr_i,
  output logic [ROWW-1:0]                     dma_rdata_o,
  input  wire logic                           dma_we_i,
  input  wire logic [AW-1:0]                  dma_waddr_i,
  input  wire logic [ROWW-1:0]                dma_wdata_i,
  input  wire logic [AW-1:0]                  mxu_waddr_i,    // weight port read
  output logic [ROWW-1:0]                     mxu_wdata_o,
  input  wire logic [AW-1:0]                  mxu_xaddr_i,    // activation (data port) read
  output logic [ROWW-1:0]                     mxu_xdata_o,
  input  wire logic [AW-1:0]                  mxu_oaddr_i,    // output row: read (mma) and write
  output logic [ROWW-1:0]                     mxu_odata_o,
  input  wire logic                           mxu_owe_i,
  input  wire logic [ROWW-1:0]                mxu_owdata_i
);
  logic [ROWW-1:0] mem_q [ROWS];

  for (genvar s = 0; s < SUBLANES; s++) begin : g_vld
    assign vld_rows_o[s] = mem_q[AW'(vld_addr_i + AW'(s))];
  end
  assign dma_rdata_o = mem_q[dma_raddr_i];
  assign mxu_wdata_o = mem_q[mxu_waddr_i];
  assign mxu_xdata_o = mem_q[mxu_xaddr_i];
  assign mxu_odata_o = mem_q[mxu_oaddr_i];

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      for (int r = 0; r < ROWS; r++) mem_q[r] <= '0;
    end else begin
      if (vst_we_i) begin
        for (int s = 0; s < SUBLANES; s++) mem_q[AW'(vst_addr_i + AW'(s))] <= vst_rows_i[s];
      end
      if (dma_we_i) mem_q[dma_waddr_i] <= dma_wdata_i;
      if (mxu_owe_i) mem_q[mxu_oaddr_i] <= mxu_owdata_i;
    end
  end
endmodule

`default_nettype wire
