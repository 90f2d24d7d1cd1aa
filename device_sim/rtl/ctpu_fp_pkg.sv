// CTPU floating-point functions: the numerics contract of docs/architecture.md in combinational logic.
//
// IEEE 754 binary32, round-to-nearest-even, subnormals kept (no flushing), every NaN result is the
// canonical quiet NaN 0x7fc00000. Written as functions (not modules) so the core calls them inside
// enabled always_ff branches: hardware-wise each is a combinational datapath feeding an enabled
// register; simulation-wise Verilator only evaluates a lane's arithmetic when an instruction uses it,
// which is what keeps the RTL fast (docs/rtl.md, "Speed").
`default_nettype none

package ctpu_fp_pkg;

  localparam logic [31:0] CANONICAL_NAN = 32'h7fc00000;
  localparam logic [15:0] CANONICAL_NAN_BF16 = 16'h7fc0;

  function automatic logic is_nan(input logic [30:0] a);
    return a[30:23] == 8'hff && a[22:0] != 23'd0;
  endfunction

  function automatic logic is_inf(input logic [30:0] a);
    return a[30:23] == 8'hff && a[22:0] == 23'd0;
  endfunction

  function automatic logic is_zero(input logic [30:0] a);
    return a[30:0] == 31'd0;
  endfunction

  // Leading zeros of a 48-bit value (48 when zero).
  function automatic logic [5:0] clz48(input logic [47:0] x);
    logic [5:0] n;
    logic found;
    n = 6'd48;
    found = 1'b0;
    for (int i = 47; i >= 0; i--) begin
      if (!found && x[i]) begin
        n = 6'(47 - i);
        found = 1'b1;
      end
    end
    return n;
  endfunction

  // Round and pack a finite nonzero magnitude: value = pn * 2^(e - 173), pn[47] = 1 (normalised).
  // Handles gradual underflow (shift right into a subnormal with sticky), RNE and overflow to inf.
  function automatic logic [31:0] round_pack(input logic sign, input int e_in, input logic [47:0] pn_in);
    logic [47:0] pn;
    logic [23:0] m;
    logic [24:0] m25;
    logic guard, sticky, up;
    int e;
    int sh;
    pn = pn_in;
    e = e_in;
    if (e < 1) begin
      // Subnormal: shift right so the exponent becomes 1 (field 0); lost bits fold into the sticky bit.
      sh = 1 - e;
      if (sh >= 48) begin
        pn = {47'd0, |pn};
      end else begin
        pn = (pn >> sh) | {47'd0, |(pn & ((48'd1 << sh) - 48'd1))};
      end
      e = 1;
    end
    m = pn[47:24];
    guard = pn[23];
    sticky = |pn[22:0];
    up = guard & (sticky | m[0]);
    m25 = {1'b0, m} + {24'd0, up};
    if (m25[24]) begin
      m = m25[24:1];
      e = e + 1;
    end else begin
      m = m25[23:0];
    end
    if (e >= 255) return {sign, 8'hff, 23'd0};
    // A subnormal that rounded up into the hidden bit becomes the smallest normal: e is 1 already.
    return {sign, m[23] ? 8'(e) : 8'd0, m[22:0]};
  endfunction

  function automatic logic [31:0] fp32_add(input logic [31:0] a, input logic [31:0] b);
    logic sa, sb, sbig, ssmall;
    logic [7:0] ea, eb;
    logic [23:0] xa, xb;
    logic [7:0] ebig, esmall;
    logic [23:0] xbig, xsmall;
    logic [27:0] big_m, small_m, s;
    logic [47:0] pn;
    logic [5:0] lz;
    int d;
    if (is_nan(a[30:0]) || is_nan(b[30:0])) return CANONICAL_NAN;
    if (is_inf(a[30:0]) && is_inf(b[30:0])) return (a[31] == b[31]) ? a : CANONICAL_NAN;
    if (is_inf(a[30:0])) return a;
    if (is_inf(b[30:0])) return b;
    sa = a[31];
    sb = b[31];
    if (is_zero(a[30:0]) && is_zero(b[30:0])) return {sa & sb, 31'd0};  // -0 + -0 = -0, else +0
    // Subnormals: exponent 1, no hidden bit.
    ea = (a[30:23] == 8'd0) ? 8'd1 : a[30:23];
    eb = (b[30:23] == 8'd0) ? 8'd1 : b[30:23];
    xa = {a[30:23] != 8'd0, a[22:0]};
    xb = {b[30:23] != 8'd0, b[22:0]};
    if ({ea, xa} >= {eb, xb}) begin
      ebig = ea; xbig = xa; sbig = sa; esmall = eb; xsmall = xb; ssmall = sb;
    end else begin
      ebig = eb; xbig = xb; sbig = sb; esmall = ea; xsmall = xa; ssmall = sa;
    end
    d = int'(ebig) - int'(esmall);
    // Three extra bits (guard, round, sticky) are enough for an exact RNE sum.
    big_m = {1'b0, xbig, 3'b000};
    if (d >= 27) begin
      small_m = {27'd0, xsmall != 24'd0};
    end else begin
      small_m = ({1'b0, xsmall, 3'b000} >> d) | {27'd0, |({1'b0, xsmall, 3'b000} & ((28'd1 << d) - 28'd1))};
    end
    s = (sbig == ssmall) ? big_m + small_m : big_m - small_m;
    if (s == 28'd0) return 32'd0;  // exact cancellation is +0 under RNE
    pn = {s, 20'd0};
    lz = clz48(pn);
    pn = pn << lz;
    return round_pack(sbig, int'(ebig) + 1 - int'(lz), pn);
  endfunction

  function automatic logic [31:0] fp32_sub(input logic [31:0] a, input logic [31:0] b);
    return fp32_add(a, {~b[31], b[30:0]});
  endfunction

  function automatic logic [31:0] fp32_mul(input logic [31:0] a, input logic [31:0] b);
    logic s;
    logic [23:0] xa, xb;
    logic [47:0] p;
    logic [5:0] lz;
    int ea, eb;
    s = a[31] ^ b[31];
    if (is_nan(a[30:0]) || is_nan(b[30:0])) return CANONICAL_NAN;
    if ((is_inf(a[30:0]) && is_zero(b[30:0])) || (is_zero(a[30:0]) && is_inf(b[30:0]))) return CANONICAL_NAN;
    if (is_inf(a[30:0]) || is_inf(b[30:0])) return {s, 8'hff, 23'd0};
    if (is_zero(a[30:0]) || is_zero(b[30:0])) return {s, 31'd0};
    ea = (a[30:23] == 8'd0) ? 1 : int'(a[30:23]);
    eb = (b[30:23] == 8'd0) ? 1 : int'(b[30:23]);
    xa = {a[30:23] != 8'd0, a[22:0]};
    xb = {b[30:23] != 8'd0, b[22:0]};
    p = {24'd0, xa} * {24'd0, xb};
    lz = clz48(p);
    return round_pack(s, ea + eb - 126 - int'(lz), p << lz);
  endfunction

  // fp32 -> bf16 bits, RNE on the bit pattern; overflow carries into inf; NaN -> canonical.
  function automatic logic [15:0] fp32_to_bf16(input logic [31:0] a);
    /* verilator lint_off UNUSEDSIGNAL */  // the low half of r is what rounding discards
    logic [31:0] r;
    if (is_nan(a[30:0])) return CANONICAL_NAN_BF16;
    // Cannot wrap: only NaN patterns (handled above) are within 0x8000 of 2^32.
    r = a + 32'h7fff + {31'd0, a[16]};
    return r[31:16];
    /* verilator lint_on UNUSEDSIGNAL */
  endfunction

  // vcvt.bf: round to bf16 precision, kept in an fp32 container.
  function automatic logic [31:0] fp32_round_bf(input logic [31:0] a);
    return {fp32_to_bf16(a), 16'd0};
  endfunction

  // vcvt.f2i: truncate toward zero, NaN -> 0, saturate at the int32 range.
  function automatic logic [31:0] fp32_to_i32(input logic [31:0] a);
    logic [23:0] x;
    logic [31:0] mag;
    int e;
    if (is_nan(a[30:0])) return 32'd0;
    e = int'(a[30:23]);
    if (e < 127) return 32'd0;
    if (e >= 158) return a[31] ? 32'h80000000 : 32'h7fffffff;
    x = {1'b1, a[22:0]};
    mag = (e >= 150) ? ({8'd0, x} << (e - 150)) : ({8'd0, x} >> (150 - e));
    return a[31] ? (~mag + 32'd1) : mag;
  endfunction

  // vcvt.i2f: int32 -> fp32, RNE.
  function automatic logic [31:0] i32_to_fp32(input logic [31:0] a);
    logic [31:0] mag;
    logic [47:0] pn;
    logic [5:0] lz;
    if (a == 32'd0) return 32'd0;
    mag = a[31] ? (~a + 32'd1) : a;
    pn = {mag, 16'd0};
    lz = clz48(pn);
    return round_pack(a[31], 158 - int'(lz), pn << lz);
  endfunction

  // a < b; false when either is NaN; -0 == +0.
  function automatic logic fp32_lt(input logic [31:0] a, input logic [31:0] b);
    if (is_nan(a[30:0]) || is_nan(b[30:0])) return 1'b0;
    if (is_zero(a[30:0]) && is_zero(b[30:0])) return 1'b0;
    if (a[31] != b[31]) return a[31];
    return a[31] ? (a[30:0] > b[30:0]) : (a[30:0] < b[30:0]);
  endfunction

  function automatic logic fp32_eq(input logic [31:0] a, input logic [31:0] b);
    if (is_nan(a[30:0]) || is_nan(b[30:0])) return 1'b0;
    return (a == b) || (is_zero(a[30:0]) && is_zero(b[30:0]));
  endfunction

  // vmax.f: b > a ? b : a; canonical NaN if either is NaN (so max(-0, +0) = -0).
  function automatic logic [31:0] fp32_max(input logic [31:0] a, input logic [31:0] b);
    if (is_nan(a[30:0]) || is_nan(b[30:0])) return CANONICAL_NAN;
    return fp32_lt(a, b) ? b : a;
  endfunction

  function automatic logic [31:0] fp32_min(input logic [31:0] a, input logic [31:0] b);
    if (is_nan(a[30:0]) || is_nan(b[30:0])) return CANONICAL_NAN;
    return fp32_lt(b, a) ? b : a;
  endfunction

endpackage

`default_nettype wire
