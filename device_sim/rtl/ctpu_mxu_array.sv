// The N x N systolic array with its input skew, weight-load delay line and output de-skew.
//
// Row r of an mm that starts at cycle s is presented at xin during cycle s+r. Activation k enters PE row k
// k cycles later (skew), moves right one PE per cycle, and the partial sums move down, so PE(k, n)
// works on row r at the end of cycle s+r+1+k+n and column n's sum leaves the bottom during s+r+N+1+n; the
// de-skew delays column n by N-1-n so the whole output row appears at out_o during s+r+2N (the MXU's
// output stage writes it at the end of that cycle, visible at s+r+2N+1 <= done = s+rows+2N).
//
// Weight loads are skewed the same way: weight row i of a load starting at s_w is presented during s_w+i
// and PE(k, n) takes its element at the end of s_w+k+n+1. A load starts no earlier than the start of the
// mm that swapped the old weights out (shadow_free), whose rows reach PE(k, n) by s_m+k+n: so a PE never
// has its weight replaced before the last row that uses it has passed, and the first row using new weights
// (start >= weights_ready = s_w+N) reaches PE(k, n) after they are written.
`default_nettype none

module ctpu_mxu_array #(
  parameter int N = 8
) (
  input  wire logic                clk,
  input  wire logic                rst_n,
  input  wire logic                xin_v_i,
  input  wire logic                xin_bank_i,
  input  wire logic [N-1:0][31:0]  xin_i,
  input  wire logic                win_v_i,
  input  wire logic [$clog2(N)-1:0] win_idx_i,   // weight row index i (vmem row sA + i)
  input  wire logic                win_bank_i,
  input  wire logic                win_t_i,     // transposed load (mxu.lwt)
  input  wire logic [N-1:0][31:0]  win_i,
  output logic [N-1:0][31:0]       out_o
);
  localparam int IW = $clog2(N);

  // input register and skew lines: lane k delayed k cycles
  logic              in_v_q, in_b_q;
  logic [N-1:0][31:0] in_q;
  logic [N-1:0][N-1:0]        sk_v_q, sk_b_q;
  logic [N-1:0][N-1:0][31:0]  sk_q;

  // weight delay line: stage j holds weight row i during s_w+i+1+j
  logic [N-1:0]              wd_v_q, wd_b_q, wd_t_q;
  logic [N-1:0][IW-1:0]      wd_i_q;
  logic [N-1:0][N-1:0][31:0] wd_q;

  // PE interconnect
  logic [N-1:0][N-1:0]       xv, xb;
  logic [N-1:0][N-1:0][31:0] xo, po;

  // de-skew: column n delayed N-1-n cycles
  logic [N-1:0][N-1:0][31:0] ds_q;

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      in_v_q <= 1'b0;
      in_b_q <= 1'b0;
      in_q <= '0;
      sk_v_q <= '0;
      sk_b_q <= '0;
      sk_q <= '0;
      wd_v_q <= '0;
      wd_b_q <= '0;
      wd_t_q <= '0;
      wd_i_q <= '0;
      wd_q <= '0;
      ds_q <= '0;
    end else begin
      in_v_q <= xin_v_i;
      if (xin_v_i) begin
        in_b_q <= xin_bank_i;
        in_q <= xin_i;
      end
      for (int k = 1; k < N; k++) begin
        sk_v_q[k][0] <= in_v_q;
        sk_b_q[k][0] <= in_b_q;
        sk_q[k][0] <= in_q[k];
        for (int m = 1; m < k; m++) begin
          sk_v_q[k][m] <= sk_v_q[k][m-1];
          sk_b_q[k][m] <= sk_b_q[k][m-1];
          sk_q[k][m] <= sk_q[k][m-1];
        end
      end
      wd_v_q[0] <= win_v_i;
      wd_b_q[0] <= win_bank_i;
      wd_t_q[0] <= win_t_i;
      wd_i_q[0] <= win_idx_i;
      wd_q[0] <= win_i;
      for (int j = 1; j < N; j++) begin
        wd_v_q[j] <= wd_v_q[j-1];
        wd_b_q[j] <= wd_b_q[j-1];
        wd_t_q[j] <= wd_t_q[j-1];
        wd_i_q[j] <= wd_i_q[j-1];
        wd_q[j] <= wd_q[j-1];
      end
      for (int n = 0; n < N - 1; n++) begin
        ds_q[n][0] <= po[N-1][n];
        for (int m = 1; m < N - 1 - n; m++) ds_q[n][m] <= ds_q[n][m-1];
      end
    end
  end

  for (genvar k = 0; k < N; k++) begin : g_row
    for (genvar n = 0; n < N; n++) begin : g_col
      logic        x_v, x_b, w_v, w_b;
      logic [31:0] x_d, p_d, w_d;
      if (n == 0) begin : g_left
        if (k == 0) begin : g_first
          assign x_v = in_v_q;
          assign x_b = in_b_q;
          assign x_d = in_q[0];
        end else begin : g_skew
          assign x_v = sk_v_q[k][k-1];
          assign x_b = sk_b_q[k][k-1];
          assign x_d = sk_q[k][k-1];
        end
      end else begin : g_inner
        assign x_v = xv[k][n-1];
        assign x_b = xb[k][n-1];
        assign x_d = xo[k][n-1];
      end
      if (k == 0) begin : g_top
        assign p_d = 32'd0;  // p = +0 before k = 0
      end else begin : g_below
        assign p_d = po[k-1][n];
      end
      // mxu.lw: weight row i = k reaches column n from stage n; mxu.lwt: row i = n reaches row k from stage k
      always_comb begin
        w_v = 1'b0;
        w_b = 1'b0;
        w_d = '0;
        if (wd_v_q[n] && !wd_t_q[n] && 32'(wd_i_q[n]) == k) begin
          w_v = 1'b1;
          w_b = wd_b_q[n];
          w_d = wd_q[n][n];
        end else if (wd_v_q[k] && wd_t_q[k] && 32'(wd_i_q[k]) == n) begin
          w_v = 1'b1;
          w_b = wd_b_q[k];
          w_d = wd_q[k][k];
        end
      end
      ctpu_mxu_pe u_pe (
        .clk    (clk),
        .rst_n  (rst_n),
        .xv_i   (x_v),
        .xbank_i(x_b),
        .x_i    (x_d),
        .p_i    (p_d),
        .wv_i   (w_v),
        .wbank_i(w_b),
        .w_i    (w_d),
        .xv_o   (xv[k][n]),
        .xbank_o(xb[k][n]),
        .x_o    (xo[k][n]),
        .p_o    (po[k][n])
      );
    end
  end

  for (genvar n = 0; n < N; n++) begin : g_out
    if (n == N - 1) begin : g_last
      assign out_o[n] = po[N-1][n];
    end else begin : g_delayed
      assign out_o[n] = ds_q[n][N-2-n];
    end
  end
endmodule

`default_nettype wire
