# 64-bit entry at 0x10000 (called by boot.S): zero .bss, install an IDT for vectors 0-31 that
# reports the fault over port 0xE9, call main, shut Bochs down.
        .section .text.entry, "ax"
        .code64
        .globl _entry
_entry:
        cld
        lea __bss_start(%rip), %rdi
        lea __bss_end(%rip), %rcx
        sub %rdi, %rcx
        xor %eax, %eax
        rep stosb
        # IDT: 32 interrupt gates
        lea idt(%rip), %rdi
        lea stubs(%rip), %rsi
        xor %ecx, %ecx
1:      mov %rsi, %rax
        mov %ax, (%rdi)
        movw $0x08, 2(%rdi)
        movw $0x8E00, 4(%rdi)
        shr $16, %rax
        mov %ax, 6(%rdi)
        shr $16, %rax
        mov %eax, 8(%rdi)
        movl $0, 12(%rdi)
        add $16, %rdi
        add $16, %rsi
        inc %ecx
        cmp $32, %ecx
        jne 1b
        lidt idtr(%rip)
        call main
        call bx_shutdown
2:      hlt
        jmp 2b

        # One 16-byte stub a vector. The CPU pushes an error code for vectors 8, 10-14, 17, 21,
        # 29 and 30; the others push a 0 in its place so that every frame has the same shape.
        .macro stub n
        .align 16
        .if (\n == 8) || (\n >= 10 && \n <= 14) || (\n == 17) || (\n == 21) \
            || (\n == 29) || (\n == 30)
        pushq $\n
        .else
        pushq $0
        pushq $\n
        .endif
        jmp common
        .endm
        .align 16
stubs:
        .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,\
                16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
        stub \n
        .endr
common:
        mov %rsp, %rdi          # [vector, error, rip, cs, rflags, ...]
        and $-16, %rsp
        call on_exception
3:      hlt
        jmp 3b

        .section .rodata
        .align 8
idtr:   .word 32*16-1
        .quad idt
        .section .bss
        .align 16
idt:    .space 32*16
