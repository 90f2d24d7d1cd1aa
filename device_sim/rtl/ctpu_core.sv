// The CTPU core: fetch/decode of 9-slot bundles, issue with the documented stalls, the scalar unit and
// sreg file, control, flags, traps and statistics; instantiates the vector unit, vmem, DMA and MXU.
//
// Cycle c counts from 0, the first cycle after reset, when bundle 0 is considered. In each cycle the
// bundle at pc either stalls (wait on a flag, full DMA FIFO, full MXU FIFO, in that order of blame) or
// issues: every slot reads registers and memories combinationally in that cycle and each result lands
// at issue + latency (no interlocks). After `halt` the core drains: done_o rises once the cycle count
// reaches max(t + 1, last landing write, last command completion), and cycles_o holds that count.
// A trap stops the core at once (trap_o, trap_code_o, trap_pc_o, trap_cycle_o). A bundle's traps are
// checked in the simulator's order (the MXU and DMA commands, then s0, s1, v0, v1, vld, vst), after its
// stalls, so both report the same kind, pc and cycle. Races with in-flight commands are not checked here:
// the simulator traps on them, and the RTL is only required to match on race-free programs.
`default_nettype none

module ctpu_core
  import ctpu_isa_pkg::*;
#(
  parameter int LANES = CFG_SMALL_LANES,
  parameter int VMEM_ROWS = CFG_SMALL_VMEM_ROWS,
  parameter longint HBM_BYTES = 64'(CFG_SMALL_HBM_BYTES),
  parameter int BPC = CFG_SMALL_HBM_BYTES_PER_CYCLE,
  parameter int DMA_LATENCY = CFG_SMALL_DMA_LATENCY,
  parameter int DMA_QUEUE = CFG_SMALL_DMA_QUEUE,
  parameter int MXU_QUEUE = CFG_SMALL_MXU_QUEUE,
  localparam int AW = $clog2(VMEM_ROWS),
  localparam int ROWW = LANES * 32,
  localparam int VW = SUBLANES * LANES * 32
) (
  input  wire logic                clk,
  input  wire logic                rst_n,
  input  wire logic [31:0]         prog_len_i,      // bundles in imem
  input  wire logic [63:0]         max_cycles_i,    // a bundle issuing later traps (runaway program)
  // launch arguments: the sreg file's contents on release (the host sets s1..s31; s0 is forced to 0)
  input  wire logic [NUM_SREGS-1:0][31:0] sreg_init_i,
  // instruction memory (asynchronous read)
  output logic [31:0]              imem_addr_o,
  input  wire logic [BUNDLE_BITS-1:0] imem_bundle_i,  // slot i in bits [32i +: 32]
  // HBM port (driven by the DMA engine)
  output logic                     hbm_re_o,
  output logic [31:0]              hbm_raddr_o,
  output logic [15:0]              hbm_rbytes_o,
  input  wire logic [ROWW-1:0]     hbm_rdata_i,
  output logic                     hbm_we_o,
  output logic [31:0]              hbm_waddr_o,
  output logic [15:0]              hbm_wbytes_o,
  output logic [ROWW-1:0]          hbm_wdata_o,
  // status
  output logic                     done_o,          // halted and drained, or trapped
  output logic                     trap_o,
  output logic [3:0]               trap_code_o,
  output logic [31:0]              trap_pc_o,
  output logic [63:0]              trap_cycle_o,
  output logic [63:0]              cycles_o,
  // statistics
  output logic [63:0]              bundles_o,
  output logic [2:0][63:0]         stalls_o,        // wait, dma_queue, mxu_queue
  output logic [NUM_SLOTS-1:0][63:0] slot_ops_o,
  output logic [63:0]              mxu_busy_o,
  output logic [63:0]              mxu_weight_loads_o,
  output logic [63:0]              dma_commands_o,
  output logic [63:0]              dma_bytes_loaded_o,
  output logic [63:0]              dma_bytes_stored_o,
  // monitor (per-bundle trace)
  output logic                     mon_issue_o,
  output logic [31:0]              mon_pc_o,
  output logic [63:0]              mon_cycle_o,
  output logic [3:0]               mon_swe_o,       // s0, s1 slot results; v0, v1 vext results
  output logic [3:0][4:0]          mon_sidx_o,
  output logic [3:0][31:0]         mon_sdata_o,
  output logic [4:0]               mon_vwe_o,
  output logic [4:0][4:0]          mon_vidx_o,
  output logic [4:0][VW-1:0]       mon_vdata_o
);
  // The harness (ctpu_tb_top) reads sregs_q, the vector unit's vregs_q and vmem's mem_q hierarchically
  // to dump the final state; silicon would expose them through a debug port.
  // ---- architectural state ----
  logic [31:0] sregs_q [NUM_SREGS];
  logic [31:0] pc_q;
  logic [63:0] cycle_q;
  logic        run_q, drain_q, done_q, trap_q;
  logic [63:0] end_q, last_land_q, max_done_q;
  logic [63:0] flag_done_q [NUM_FLAGS];

  // ---- decode ----
  logic [NUM_SLOTS-1:0][31:0] w;
  logic [NUM_SLOTS-1:0][7:0]  op;
  logic [NUM_SLOTS-1:0][4:0]  fd, fa, fb, fc;
  logic [NUM_SLOTS-1:0][3:0]  fflag;
  logic [NUM_SLOTS-1:0][31:0] imm14, imm19;
  logic [NUM_SLOTS-1:0]       used, legal;

  always_comb begin
    for (int i = 0; i < NUM_SLOTS; i++) begin
      w[i] = imem_bundle_i[i*32 +: 32];
      op[i] = w[i][OPCODE_HI:OPCODE_LO];
      fd[i] = w[i][F_D_HI:F_D_LO];
      fa[i] = w[i][F_A_HI:F_A_LO];
      fb[i] = w[i][F_B_HI:F_B_LO];
      fc[i] = w[i][F_C_HI:F_C_LO];
      fflag[i] = w[i][F_FLAG_HI:F_FLAG_LO];
      imm14[i] = 32'($signed(w[i][F_IMM14_HI:F_IMM14_LO]));
      imm19[i] = 32'($signed(w[i][F_IMM19_HI:F_IMM19_LO]));
      used[i] = op[i] != OP_NOP;
      legal[i] = op_known(op[i]) && (op[i] == OP_NOP || op_unit(op[i]) == slot_unit(i))
                 && (w[i] & ~op_used_mask(op[i])) == 32'd0 && op_imm_ok(op[i], imm19[i]);
    end
  end

  function automatic logic [31:0] sreg(input logic [4:0] idx);
    return sregs_q[idx];
  endfunction

  // ---- stalls ----
  logic wait_stall, dma_stall, mxu_stall, stall;
  logic dma_full, mxu_full;
  logic considering, pc_bad, illegal, over_limit;

  assign considering = run_q && !trap_q;
  assign pc_bad = pc_q >= prog_len_i;
  assign illegal = !(&legal);
  assign wait_stall = op[SLOT_CTRL] == OP_WAIT && flag_done_q[fflag[SLOT_CTRL]] > cycle_q;
  assign dma_stall = used[SLOT_DMA] && dma_full;
  assign mxu_stall = used[SLOT_MXU] && mxu_full;
  assign stall = wait_stall || dma_stall || mxu_stall;
  assign over_limit = cycle_q > max_cycles_i;

  // ---- unit checks for the bundle (traps it would raise on issue) ----
  logic dma_trap, mxu_trap;
  logic [2:0] vconflict;  // per slot: v0, v1, vld
  logic [3:0] dma_code, mxu_code;
  logic [63:0] dma_done, mxu_done;
  logic [63:0] vld_row, vst_row;
  logic vld_bad, vst_bad;
  logic [1:0] vext_bad;   // per vector slot
  logic [2:0] sconflict;  // s0, s1, v1's vext (v0's vext lands first at t + 2)
  // vext (vector slot, LAT_VALU) writes an sreg: value captured at the end of t, written at the end of t+1
  logic [1:0]       vx_v_q;
  logic [1:0][4:0]  vx_d_q;
  logic [1:0][31:0] vx_q;
  logic [1:0]       is_vext;
  logic [1:0][VW-1:0] alu_va;

  always_comb begin
    vld_row = 64'(sreg(fa[SLOT_VLD])) + 64'($signed(imm14[SLOT_VLD]));
    vst_row = 64'(sreg(fa[SLOT_VST])) + 64'($signed(imm14[SLOT_VST]));
    // rows are exact (unsigned register + signed offset): negative or past the end is out of bounds
    vld_bad = used[SLOT_VLD] && ($signed(vld_row) < 0
              || vld_row + ((op[SLOT_VLD] == OP_VLD_ROW) ? 64'd1 : 64'(SUBLANES)) > 64'(VMEM_ROWS));
    vst_bad = used[SLOT_VST] && ($signed(vst_row) < 0 || vst_row + 64'(SUBLANES) > 64'(VMEM_ROWS));
    is_vext = {op[SLOT_V1] == OP_VEXT, op[SLOT_V0] == OP_VEXT};
    // unsigned compare: a negative immediate is out of range too
    vext_bad[0] = is_vext[0] && (imm14[SLOT_V0] >= 32'(SUBLANES * LANES));
    vext_bad[1] = is_vext[1] && (imm14[SLOT_V1] >= 32'(SUBLANES * LANES));
    // sreg results landing at t+1: vexts issued at t-1, then this bundle's s0, s1; at t+2: this bundle's
    // vexts, v0's before v1's (s0 included: a write to s0 is dropped but still collides)
    sconflict = '0;
    for (int k = 0; k < 2; k++) begin
      for (int j = 0; j < 2; j++) begin
        if (used[k] && vx_v_q[j] && fd[k] == vx_d_q[j]) sconflict[k] = 1'b1;
      end
    end
    if (used[SLOT_S0] && used[SLOT_S1] && fd[SLOT_S0] == fd[SLOT_S1]) sconflict[1] = 1'b1;
    sconflict[2] = is_vext[0] && is_vext[1] && fd[SLOT_V0] == fd[SLOT_V1];
  end

  // trap code for this cycle (0: none), in the simulator's order
  logic [3:0] trap_now;
  always_comb begin
    trap_now = TRAP_NONE;
    if (considering) begin
      if (pc_bad) trap_now = TRAP_PC_END;
      else if (illegal) trap_now = TRAP_ILLEGAL;
      else if (!stall) begin
        if (over_limit) trap_now = TRAP_CYCLE_LIMIT;
        else if (mxu_trap) trap_now = mxu_code;
        else if (dma_trap) trap_now = dma_code;
        else if (sconflict[0] || sconflict[1]) trap_now = TRAP_WRITE_CONFLICT;
        else if (vext_bad[0]) trap_now = TRAP_LANE_RANGE;
        else if (vconflict[0]) trap_now = TRAP_WRITE_CONFLICT;
        else if (vext_bad[1]) trap_now = TRAP_LANE_RANGE;
        else if (vconflict[1] || sconflict[2]) trap_now = TRAP_WRITE_CONFLICT;
        else if (vld_bad) trap_now = TRAP_VMEM_OOB;
        else if (vconflict[2]) trap_now = TRAP_WRITE_CONFLICT;
        else if (vst_bad) trap_now = TRAP_VMEM_OOB;
      end
    end
  end

  logic issue;
  assign issue = considering && !pc_bad && !illegal && !over_limit && !stall && trap_now == TRAP_NONE;

  // ---- scalar unit ----
  logic [1:0][31:0] s_res;
  for (genvar k = 0; k < 2; k++) begin : g_salu
    ctpu_scalar_alu u_salu (
      .op_i (op[k]),
      .a_i  (sreg(fa[k])),
      .b_i  (sreg(fb[k])),
      .d_lo_i(sreg(fd[k])[15:0]),
      .imm_i((op[k] == OP_LI) ? imm19[k] : (op[k] == OP_LIH) ? {16'd0, w[k][15:0]} : imm14[k]),
      .y_o  (s_res[k])
    );
  end

  // ---- vector unit and vmem ----
  logic [SUBLANES-1:0][ROWW-1:0] vld_rows;
  logic [VW-1:0] vst_data;
  logic [SUBLANES-1:0][ROWW-1:0] vst_rows;
  logic [AW-1:0] dma_vraddr, dma_vwaddr, mxu_waddr, mxu_xaddr, mxu_oaddr;
  logic [ROWW-1:0] dma_vrdata, dma_vwdata, mxu_wdata, mxu_xdata, mxu_odata, mxu_owdata;
  logic dma_vwe, mxu_owe;

  ctpu_vector_unit #(.LANES(LANES)) u_vector (
    .clk         (clk),
    .rst_n       (rst_n),
    .alu_issue_i ({issue && used[SLOT_V1], issue && used[SLOT_V0]}),
    .alu_used_i  ({used[SLOT_V1], used[SLOT_V0]}),
    .alu_op_i    ({op[SLOT_V1], op[SLOT_V0]}),
    .alu_d_i     ({fd[SLOT_V1], fd[SLOT_V0]}),
    .alu_a_i     ({fa[SLOT_V1], fa[SLOT_V0]}),
    .alu_b_i     ({fb[SLOT_V1], fb[SLOT_V0]}),
    .alu_c_i     ({fc[SLOT_V1], fc[SLOT_V0]}),
    .alu_iota_i  ({imm19[SLOT_V1][1:0], imm19[SLOT_V0][1:0]}),
    .alu_s_i     ({sreg(fa[SLOT_V1]), sreg(fa[SLOT_V0])}),
    .vld_issue_i (issue && used[SLOT_VLD]),
    .vld_used_i  (used[SLOT_VLD]),
    .vld_row_i   (op[SLOT_VLD] == OP_VLD_ROW),
    .vld_d_i     (fd[SLOT_VLD]),
    .vld_rows_i  (vld_rows),
    .vst_d_i     (fd[SLOT_VST]),
    .vst_data_o  (vst_data),
    .alu_va_o    (alu_va),
    .check_i     (considering),
    .conflict_o  (vconflict),
    .mon_we_o    (mon_vwe_o),
    .mon_idx_o   (mon_vidx_o),
    .mon_data_o  (mon_vdata_o)
  );

  assign vst_rows = vst_data;

  ctpu_vmem #(.LANES(LANES), .ROWS(VMEM_ROWS)) u_vmem (
    .clk         (clk),
    .rst_n       (rst_n),
    .vld_addr_i  (AW'(vld_row)),
    .vld_rows_o  (vld_rows),
    .vst_we_i    (issue && used[SLOT_VST]),
    .vst_addr_i  (AW'(vst_row)),
    .vst_rows_i  (vst_rows),
    .dma_raddr_i (dma_vraddr),
    .dma_rdata_o (dma_vrdata),
    .dma_we_i    (dma_vwe),
    .dma_waddr_i (dma_vwaddr),
    .dma_wdata_i (dma_vwdata),
    .mxu_waddr_i (mxu_waddr),
    .mxu_wdata_o (mxu_wdata),
    .mxu_xaddr_i (mxu_xaddr),
    .mxu_xdata_o (mxu_xdata),
    .mxu_oaddr_i (mxu_oaddr),
    .mxu_odata_o (mxu_odata),
    .mxu_owe_i   (mxu_owe),
    .mxu_owdata_i(mxu_owdata)
  );

  // ---- DMA ----
  ctpu_dma #(
    .LANES(LANES), .VMEM_ROWS(VMEM_ROWS), .HBM_BYTES(HBM_BYTES), .BPC(BPC), .LATENCY(DMA_LATENCY),
    .QUEUE(DMA_QUEUE)
  ) u_dma (
    .clk           (clk),
    .rst_n         (rst_n),
    .cycle_i       (cycle_q),
    .check_i       (considering && used[SLOT_DMA]),
    .issue_i       (issue && used[SLOT_DMA]),
    .store_i       (op[SLOT_DMA] == OP_DMA_ST || op[SLOT_DMA] == OP_DMA_ST_BF16),
    .bf16_i        (op[SLOT_DMA] == OP_DMA_LD_BF16 || op[SLOT_DMA] == OP_DMA_ST_BF16),
    .hbm_i         (sreg(fa[SLOT_DMA])),
    .vrow_i        (sreg(fb[SLOT_DMA])),
    .shape_i       (sreg(fc[SLOT_DMA])),
    .stride_i      (sreg(fd[SLOT_DMA])),
    .trap_o        (dma_trap),
    .trap_code_o   (dma_code),
    .full_o        (dma_full),
    .done_o        (dma_done),
    .vmem_raddr_o  (dma_vraddr),
    .vmem_rdata_i  (dma_vrdata),
    .vmem_we_o     (dma_vwe),
    .vmem_waddr_o  (dma_vwaddr),
    .vmem_wdata_o  (dma_vwdata),
    .hbm_re_o      (hbm_re_o),
    .hbm_raddr_o   (hbm_raddr_o),
    .hbm_rbytes_o  (hbm_rbytes_o),
    .hbm_rdata_i   (hbm_rdata_i),
    .hbm_we_o      (hbm_we_o),
    .hbm_waddr_o   (hbm_waddr_o),
    .hbm_wbytes_o  (hbm_wbytes_o),
    .hbm_wdata_o   (hbm_wdata_o),
    .commands_o    (dma_commands_o),
    .bytes_loaded_o(dma_bytes_loaded_o),
    .bytes_stored_o(dma_bytes_stored_o)
  );

  // ---- MXU ----
  ctpu_mxu #(.N(LANES), .VMEM_ROWS(VMEM_ROWS), .QUEUE(MXU_QUEUE)) u_mxu (
    .clk           (clk),
    .rst_n         (rst_n),
    .cycle_i       (cycle_q),
    .check_i       (considering && used[SLOT_MXU]),
    .issue_i       (issue && used[SLOT_MXU]),
    .op_i          (op[SLOT_MXU]),
    .sa_i          (sreg(fa[SLOT_MXU])),
    .sb_i          (sreg(fb[SLOT_MXU])),
    .sc_i          (sreg(fc[SLOT_MXU])),
    .trap_o        (mxu_trap),
    .trap_code_o   (mxu_code),
    .full_o        (mxu_full),
    .done_o        (mxu_done),
    .w_addr_o      (mxu_waddr),
    .w_data_i      (mxu_wdata),
    .x_addr_o      (mxu_xaddr),
    .x_data_i      (mxu_xdata),
    .o_addr_o      (mxu_oaddr),
    .o_data_i      (mxu_odata),
    .o_we_o        (mxu_owe),
    .o_wdata_o     (mxu_owdata),
    .busy_cycles_o (mxu_busy_o),
    .weight_loads_o(mxu_weight_loads_o)
  );

  // ---- landing and completion bookkeeping for halt's drain ----
  logic [63:0] land_new, done_new, end_new;
  always_comb begin
    land_new = last_land_q;
    for (int i = 0; i < NUM_SLOTS; i++) begin
      if (used[i] && op_latency(op[i]) > 0 && cycle_q + 64'(op_latency(op[i])) > land_new)
        land_new = cycle_q + 64'(op_latency(op[i]));
    end
    done_new = max_done_q;
    if (used[SLOT_DMA] && dma_done > done_new) done_new = dma_done;
    if (used[SLOT_MXU] && mxu_done > done_new) done_new = mxu_done;
    end_new = cycle_q + 64'd1;
    if (land_new > end_new) end_new = land_new;
    if (done_new > end_new) end_new = done_new;
  end

  // ---- control: next pc ----
  logic [31:0] next_pc;
  logic halt_now;
  always_comb begin
    next_pc = pc_q + 32'd1;
    case (op[SLOT_CTRL])
      OP_JMP: next_pc = imm19[SLOT_CTRL];
      OP_BNZ: if (sreg(fd[SLOT_CTRL]) != 32'd0) next_pc = imm19[SLOT_CTRL];
      OP_BZ:  if (sreg(fd[SLOT_CTRL]) == 32'd0) next_pc = imm19[SLOT_CTRL];
      default: ;
    endcase
    halt_now = op[SLOT_CTRL] == OP_HALT;
  end

  always_ff @(posedge clk or negedge rst_n) begin
    if (!rst_n) begin
      sregs_q[0] <= '0;
      for (int r = 1; r < NUM_SREGS; r++) sregs_q[r] <= sreg_init_i[r];
      for (int f = 0; f < NUM_FLAGS; f++) flag_done_q[f] <= '0;
      vx_v_q <= '0;
      vx_d_q <= '0;
      vx_q <= '0;
      pc_q <= '0;
      cycle_q <= '0;
      run_q <= 1'b1;
      drain_q <= 1'b0;
      done_q <= 1'b0;
      trap_q <= 1'b0;
      trap_code_o <= TRAP_NONE;
      trap_pc_o <= '0;
      trap_cycle_o <= '0;
      end_q <= '0;
      last_land_q <= '0;
      max_done_q <= '0;
      bundles_o <= '0;
      stalls_o <= '0;
      slot_ops_o <= '0;
    end else if (!trap_q && !done_q) begin
      cycle_q <= cycle_q + 64'd1;
      if (trap_now != TRAP_NONE) begin
        trap_q <= 1'b1;
        trap_code_o <= trap_now;
        trap_pc_o <= pc_q;
        trap_cycle_o <= cycle_q;
      end else if (considering && stall) begin
        if (wait_stall) stalls_o[0] <= stalls_o[0] + 64'd1;
        else if (dma_stall) stalls_o[1] <= stalls_o[1] + 64'd1;
        else stalls_o[2] <= stalls_o[2] + 64'd1;
      end
      // vexts issued last cycle land now (s0 stays zero)
      for (int k = 0; k < 2; k++) if (vx_v_q[k] && vx_d_q[k] != 5'd0) sregs_q[vx_d_q[k]] <= vx_q[k];
      vx_v_q <= '0;
      if (issue) begin
        for (int k = 0; k < 2; k++) begin
          if (used[k] && fd[k] != 5'd0) sregs_q[fd[k]] <= s_res[k];
          if (is_vext[k]) begin
            vx_v_q[k] <= 1'b1;
            vx_d_q[k] <= fd[SLOT_V0 + k];
            vx_q[k] <= alu_va[k][imm14[SLOT_V0 + k][$clog2(SUBLANES * LANES)-1:0]*32 +: 32];
          end
        end
        if (used[SLOT_DMA] && dma_done > flag_done_q[fflag[SLOT_DMA]])
          flag_done_q[fflag[SLOT_DMA]] <= dma_done;
        // the MXU command counts on its flag too; both may name the same flag
        if (used[SLOT_MXU] && mxu_done > flag_done_q[fflag[SLOT_MXU]]
            && !(used[SLOT_DMA] && fflag[SLOT_DMA] == fflag[SLOT_MXU] && dma_done > mxu_done))
          flag_done_q[fflag[SLOT_MXU]] <= mxu_done;
        last_land_q <= land_new;
        max_done_q <= done_new;
        bundles_o <= bundles_o + 64'd1;
        for (int i = 0; i < NUM_SLOTS; i++) if (used[i]) slot_ops_o[i] <= slot_ops_o[i] + 64'd1;
        pc_q <= next_pc;
        if (halt_now) begin
          run_q <= 1'b0;
          drain_q <= 1'b1;
          end_q <= end_new;
        end
      end
      if (drain_q && cycle_q >= end_q) done_q <= 1'b1;
    end
  end

  assign imem_addr_o = pc_q;
  assign done_o = done_q || trap_q;
  assign trap_o = trap_q;
  assign cycles_o = trap_q ? cycle_q : end_q;
  assign mon_issue_o = issue;
  assign mon_pc_o = pc_q;
  assign mon_cycle_o = cycle_q;
  always_comb begin
    for (int k = 0; k < 2; k++) begin
      // scalar results land at the end of this cycle; vext results (issued last cycle) too
      mon_swe_o[k] = issue && used[k] && fd[k] != 5'd0;
      mon_sidx_o[k] = fd[k];
      mon_sdata_o[k] = s_res[k];
      mon_swe_o[2 + k] = vx_v_q[k] && vx_d_q[k] != 5'd0;
      mon_sidx_o[2 + k] = vx_d_q[k];
      mon_sdata_o[2 + k] = vx_q[k];
    end
  end
endmodule

`default_nettype wire
