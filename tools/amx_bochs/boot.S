# Boot sector: loads the 64-bit program (sectors 1..NSECT of the disk) to 0x10000 with
# int 13h extended reads, builds identity-mapped page tables (1 GiB, 2 MiB pages), enters
# long mode directly from real mode, enables SSE/XSAVE, sets XCR0 = 0x600E7 and jumps to 0x10000.
        .code16
        .section .text
        .globl _start
_start:
        cli
        xor %ax, %ax
        mov %ax, %ds
        mov %ax, %es
        mov %ax, %ss
        mov $0x7c00, %sp
        mov %dl, bootdrv
        # fast A20
        in $0x92, %al
        or $2, %al
        and $0xfe, %al
        out %al, $0x92
        # load NSECT sectors, 64 at a time
        movw $NSECT, left
1:      cmpw $0, left
        je 3f
        mov left, %ax
        cmp $64, %ax
        jbe 2f
        mov $64, %ax
2:      mov %ax, dap_count
        mov $dap, %si
        mov bootdrv, %dl
        mov $0x42, %ah
        int $0x13
        jc diskerr
        mov dap_count, %ax
        sub %ax, left
        add %ax, dap_lba
        shl $5, %ax              # sectors * 512 / 16 = paragraphs
        add %ax, dap_seg
        jmp 1b
3:      cli                       # (the BIOS's int 13h may have set IF) no interrupts from here on
        mov $0xff, %al            # mask both PICs
        out %al, $0x21
        out %al, $0xa1
        # page tables: PML4 0x1000, PDPT 0x2000, PD 0x3000
        cld
        mov $0x1000, %di
        xor %eax, %eax
        mov $(3*1024), %ecx
        rep stosl
        movl $0x2003, 0x1000
        movl $0x3003, 0x2000
        mov $0x3000, %di
        mov $0x83, %eax          # present, writable, 2 MiB page
        mov $512, %cx
4:      mov %eax, (%di)
        movl $0, 4(%di)
        add $0x200000, %eax
        add $8, %di
        loop 4b
        # long mode
        lgdt gdtr
        mov $0x6a0, %eax          # PAE | OSFXSR | OSXMMEXCPT | PGE
        or $0x40000, %eax         # OSXSAVE
        mov %eax, %cr4
        mov $0x1000, %eax
        mov %eax, %cr3
        mov $0xC0000080, %ecx
        rdmsr
        or $0x100, %eax           # LME
        wrmsr
        mov %cr0, %eax
        and $0xfffffffb, %eax     # clear EM
        or $0x80000003, %eax      # PG | MP | PE
        mov %eax, %cr0
        ljmpl $0x08, $long64

diskerr:
        mov $'D', %al
        out %al, $0xe9
        hlt
        jmp diskerr

        .code64
long64:
        mov $0x10, %ax
        mov %ax, %ds
        mov %ax, %es
        mov %ax, %ss
        xor %ax, %ax
        mov %ax, %fs
        mov %ax, %gs
        xor %ecx, %ecx
        mov $0x600E7, %eax
        xor %edx, %edx
        xsetbv
        mov $0x1000000, %rsp      # 16 MiB
        mov $0x10000, %rax
        call *%rax
        hlt

        .align 8
gdt:    .quad 0
        .quad 0x00209A0000000000  # 64-bit code
        .quad 0x0000920000000000  # data
gdtr:   .word 23
        .long gdt
        .align 4
dap:    .byte 16, 0
dap_count: .word 0
dap_off: .word 0
dap_seg: .word 0x1000
dap_lba: .quad 1
left:   .word 0
bootdrv: .byte 0
        .org 510
        .byte 0x55, 0xaa
