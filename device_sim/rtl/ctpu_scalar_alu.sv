// One scalar ALU slot (s0 or s1): 32-bit integer operations, combinational; the core writes the result
// to the sreg file at the end of the issue cycle (LAT_SCALAR = 1).
`default_nettype none

module ctpu_scalar_alu
  import ctpu_isa_pkg::*;
(
  input  wire logic [7:0]  op_i,
  input  wire logic [31:0] a_i,     // sreg[a]
  input  wire logic [31:0] b_i,     // sreg[b]
  input  wire logic [15:0] d_lo_i,  // low half of sreg[d] (lih keeps it)
  input  wire logic [31:0] imm_i,   // sign-extended imm14 (RI) or imm19 (li); imm16 for lih
  output logic [31:0]      y_o
);
  function automatic logic [31:0] alu(input logic [7:0] op, input logic [31:0] a, input logic [31:0] b);
    case (op)
      OP_ADD, OP_ADDI: return a + b;
      OP_SUB:          return a - b;
      OP_MUL:          return a * b;
      OP_AND, OP_ANDI: return a & b;
      OP_OR, OP_ORI:   return a | b;
      OP_XOR, OP_XORI: return a ^ b;
      OP_SHL, OP_SHLI: return a << b[4:0];
      OP_SHR, OP_SHRI: return a >> b[4:0];
      OP_SRA, OP_SRAI: return 32'($signed(a) >>> b[4:0]);
      OP_SLT, OP_SLTI: return {31'd0, $signed(a) < $signed(b)};
      OP_SLTU:         return {31'd0, a < b};
      OP_MIN:          return ($signed(a) < $signed(b)) ? a : b;
      OP_MAX:          return ($signed(a) > $signed(b)) ? a : b;
      default:         return 32'd0;
    endcase
  endfunction

  always_comb begin
    case (op_i)
      OP_LI:   y_o = imm_i;
      OP_LIH:  y_o = {imm_i[15:0], d_lo_i};
      OP_ADDI, OP_ANDI, OP_ORI, OP_XORI, OP_SHLI, OP_SHRI, OP_SRAI, OP_SLTI: y_o = alu(op_i, a_i, imm_i);
      default: y_o = alu(op_i, a_i, b_i);
    endcase
  end
endmodule

`default_nettype wire
