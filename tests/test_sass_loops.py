"""`compile_offline.loop_mix`, the SASS loop reader behind `kernels/cute/compile_offline.py --loops` (a kernel's
instructions an iteration without a GPU): on a hand-written cuobjdump-style listing, two nested loops and a forward
branch."""
from k3lab_kernels.cute import compile_offline as co

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R5, R4, 0x8e008e00, RZ, 0xc0, !PT ;
        /*0040*/                   IMAD.SHL.U32 R6, R4, 0x100, RZ ;
        /*0050*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0060*/              @!P0 BRA 0x20 ;
        /*0070*/                   FFMA R9, R8, R8, R9 ;
        /*0080*/               @P1 BRA 0xa0 ;
        /*0090*/                   BRA 0x10 ;
        /*00a0*/                   EXIT ;
"""


def test_loop_mix_reads_nested_loops_innermost_first():
    loops = co.loop_mix(SASS, min_instructions=1)
    assert [(d["start"], d["end"], d["instructions"]) for d in loops] == [(0x20, 0x60, 5), (0x10, 0x90, 9)]
    inner = loops[0]["mix"]
    assert inner == {"LDG.E.128": 1, "LOP3.LUT": 1, "IMAD.SHL.U32": 1, "HMMA.16816.F32": 1, "BRA": 1}
    assert co.loop_mix(SASS) == []          # none of 40 instructions or more
    assert co.loop_mix("") == []
