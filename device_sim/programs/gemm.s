# gemm.s: C[512,512] fp32 = A[512,512] bf16 @ B[512,512] bf16 on `small` (8x8 MXU, 4096 vmem rows).
#
# Blocking. C is computed in 32 blocks of 128 rows x 64 cols (block b: mb = b/8, nb = b%8). A block is
# 8 n-tiles of 128 x 8, each held in vmem as 128 consecutive rows, accumulated over the 64 k-steps
# (k-tiles of 8). One k-step = 8 x (mxu.lw of B[k-tile, n-tile j]; mxu.mms/mmas streaming the 128 rows of
# A[m rows, k-tile] into C n-tile j): 8 x 128 = 1024 MXU cycles per 192 vmem rows of DMA (A 128, B 64).
# The MXU array is never idle: each lw (8 cycles on the weight port) loads the shadow buffer while the
# previous mm streams its 128 rows, and the next mm swaps it in (architecture.md, MXU timing).
#
# vmem (rows):  A tiles 2 x 128 at 0 / 128 | B tiles 2 x 64 at 256 / 320 | C blocks 2 x 1024 at 384 / 1408
#   A tile: A[m0:m0+128, 8k:8k+8] = 128 rows (dma cols 8).  B tile: 8 DMAs of B[8k:8k+8, n0+8j:+8] = 8 rows
#   each, n-tile j at +8j (mxu.lw wants W's 8 rows consecutive).  C block: n-tile j at +128j.
# Double buffering: the tiles of step L+1 load (flag f0) while step L streams; C blocks alternate so the
# stores of block b-1 (flag f4) overlap block b: one 128x8 n-tile per k-step, in k-steps 0..7, so the
# 8-deep DMA FIFO never fills with stores ahead of a step's 9 loads (that stalled issue and drained the MXU). Flags: f0 loads, f1 lw, f2 mm, f3 the LAST mm of each
# step (mms complete in order, so waiting f3 = the whole step is done), f4 C stores.
# Order of accumulation, per C element: k-tile 0 (mxu.mms, writes) then k-tiles 1..63 (mxu.mmas), each
# tile an 8-term k-ascending fp32 sum (the MXU): references.gemm_mxu_order models exactly this.
#
# sregs: s1 128 (mm rows)  s2 512 (HBM row stride)  s3 shape 128x8 (A tile, C store)  s4 shape 8x8 (B tile)
#   s5/s6 A cur/next  s7/s8 B cur/next  s9/s10 C cur/prev  s11 lw walker  s12 mm output walker
#   s13 HBM A tile  s15/s16 B DMA walkers (vmem/HBM)  s17 L = index of the next step to load
#   s18 k-steps left  s19/s20 C store walkers (HBM/vmem)  s31 C tiles left to store  s21 s22 s25 temporaries  s23/s24/s14 buffer xors
#   s26 B base  s27 C base  s28 blocks left  s29 block b  s30 HBM address of C block b
.equ A_HBM, 0x0
.equ B_HBM, 0x80000
.equ C_HBM, 0x100000
.equ VA0, 0
.equ VA1, 128
.equ VB0, 256
.equ VB1, 320
.equ VC0, 384
.equ VC1, 1408
.equ BLOCKS, 32
.equ KSTEPS, 64

    li s1, 128 ; li s2, 512
    li s3, 8 ; li s4, 8
    lih s3, 128 ; lih s4, 8                      # shapes rows<<16 | cols: 128x8 and 8x8
    li s5, VA1 ; li s6, VA0                      # "next" = buffer 0: the first step swaps it in
    li s7, VB1 ; li s8, VB0
    li s9, VC0 ; li s10, VC1
    li s23, VA0 ^ VA1 ; li s24, VB0 ^ VB1
    li s14, VC0 ^ VC1 ; li s26, lo(B_HBM)
    lih s26, hi(B_HBM) ; li s27, lo(C_HBM)
    lih s27, hi(C_HBM) ; li s28, BLOCKS
    li s17, 0 ; li s29, 0
    # prologue: issue the loads of step L = 0 (block 0, k-step 0)
    shri s21, s17, 6 ; andi s22, s17, 63      # load index L -> block b = L/64, k-step = L%64
    shri s25, s21, 3 ; andi s21, s21, 7           # mb = b/8, nb = b%8
    shli s25, s25, 17 ; shli s13, s22, 4          # mb*128 rows*512*2 B ; k*8 cols*2 B
    add s13, s13, s25 ; shli s21, s21, 7           # s13 = HBM A tile ; nb*64 cols*2 B
    shli s22, s22, 13 ; add s15, s8, s0 ; dma.ld.bf16 s13, s6, s3, s2, f0   # A[mb rows, k cols] -> next A buffer
    add s16, s21, s22 ; addi s17, s17, 1           # B tile offset ; L += 1
    add s16, s16, s26                         # HBM address of B[k rows, first n-tile]
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 0
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 1
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 2
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 3
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 4
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 5
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 6
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 7
block:
    wait f4 ; shri s21, s29, 3 ; andi s22, s29, 7   # C cur was stored (block b-2) before we overwrite it
    shli s21, s21, 18 ; shli s22, s22, 8             # mb*128*512*4 B ; nb*64*4 B
    add s21, s21, s22 ; add s19, s30, s0              # C offset of block b ; store walker: C block b-1
    add s30, s21, s27 ; sltu s31, s0, s29             # HBM address of C block b ; b > 0 ?
    shli s31, s31, 3 ; add s20, s10, s0               # 8 C tiles of block b-1 to store (0 for b = 0)
    # k-step 0 of the block: mxu.mms writes C (no accumulate)
kstep0:
    wait f0 ; xor s5, s5, s23 ; xor s6, s6, s23    # this step's tiles have landed; swap A cur/next
    xor s7, s7, s24 ; xor s8, s8, s24              # swap B cur/next
    add s11, s7, s0 ; add s12, s9, s0              # walkers: weight tile rows, C output rows
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 0) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 0
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 1) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 1
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 2) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 2
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 3) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 3
    # 8 MXU commands issued, so (FIFO depth 4) this step's mms 1 has started: the previous step's last mm
    # (flag f3) is done and the next buffers are free: load step L's tiles into them.
    wait f3 ; shri s21, s17, 6 ; andi s22, s17, 63      # load index L -> block b = L/64, k-step = L%64
    shri s25, s21, 3 ; andi s21, s21, 7           # mb = b/8, nb = b%8
    shli s25, s25, 17 ; shli s13, s22, 4          # mb*128 rows*512*2 B ; k*8 cols*2 B
    add s13, s13, s25 ; shli s21, s21, 7           # s13 = HBM A tile ; nb*64 cols*2 B
    shli s22, s22, 13 ; add s15, s8, s0 ; dma.ld.bf16 s13, s6, s3, s2, f0   # A[mb rows, k cols] -> next A buffer
    add s16, s21, s22 ; addi s17, s17, 1           # B tile offset ; L += 1
    add s16, s16, s26                         # HBM address of B[k rows, first n-tile]
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 0
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 1
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 2
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 3
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 4
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 5
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 6
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 7
    bz s31, nostore_k0                             # C tiles of block b-1 still to store?
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # one 128x8 C n-tile of block b-1
    addi s31, s31, -1
nostore_k0:
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 4) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 4
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 5) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 5
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 6) -> shadow
    mxu.mms s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 6
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 7) -> shadow
    mxu.mms s5, s12, s1, f3 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 7
kloop_init:
    li s18, KSTEPS - 1
kloop:
    wait f0 ; xor s5, s5, s23 ; xor s6, s6, s23    # this step's tiles have landed; swap A cur/next
    xor s7, s7, s24 ; xor s8, s8, s24              # swap B cur/next
    add s11, s7, s0 ; add s12, s9, s0              # walkers: weight tile rows, C output rows
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 0) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 0
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 1) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 1
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 2) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 2
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 3) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 3
    # 8 MXU commands issued, so (FIFO depth 4) this step's mms 1 has started: the previous step's last mm
    # (flag f3) is done and the next buffers are free: load step L's tiles into them.
    wait f3 ; shri s21, s17, 6 ; andi s22, s17, 63      # load index L -> block b = L/64, k-step = L%64
    shri s25, s21, 3 ; andi s21, s21, 7           # mb = b/8, nb = b%8
    shli s25, s25, 17 ; shli s13, s22, 4          # mb*128 rows*512*2 B ; k*8 cols*2 B
    add s13, s13, s25 ; shli s21, s21, 7           # s13 = HBM A tile ; nb*64 cols*2 B
    shli s22, s22, 13 ; add s15, s8, s0 ; dma.ld.bf16 s13, s6, s3, s2, f0   # A[mb rows, k cols] -> next A buffer
    add s16, s21, s22 ; addi s17, s17, 1           # B tile offset ; L += 1
    add s16, s16, s26 ; addi s18, s18, -1       # B tile address ; one k-step fewer to go
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 0
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 1
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 2
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 3
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 4
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 5
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 6
    dma.ld.bf16 s16, s15, s4, s2, f0 ; addi s16, s16, 16 ; addi s15, s15, 8   # B n-tile 7
    bz s31, nostore_kl                             # C tiles of block b-1 still to store?
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # one 128x8 C n-tile of block b-1
    addi s31, s31, -1
nostore_kl:
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 4) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 4
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 5) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 5
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 6) -> shadow
    mxu.mmas s5, s12, s1, f2 ; addi s12, s12, 128       # swap in W, stream 128 A rows into C n-tile 6
    mxu.lw s11, f1 ; addi s11, s11, 8                 # W(k, n-tile 7) -> shadow
    mxu.mmas s5, s12, s1, f3 ; addi s12, s12, 128 ; bnz s18, kloop   # last mm of the step on f3
    addi s28, s28, -1 ; addi s29, s29, 1
    xor s9, s9, s14 ; xor s10, s10, s14 ; bnz s28, block   # swap C cur/prev; next block
    # epilogue: the last block's C (now C prev) once its last mm is done
    wait f3 ; add s19, s30, s0 ; add s20, s10, s0
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 0 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 1 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 2 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 3 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 4 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 5 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 6 of the last block
    dma.st s19, s20, s3, s2, f4 ; addi s19, s19, 32 ; addi s20, s20, 128   # C n-tile 7 of the last block
    halt                                         # the run drains the stores
