_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_15Mxfp4AvxDecoderEEEvPKhS4_PKtlllPf:
.LFB10772:
	.cfi_startproc
	pushq	%rbp
	.cfi_def_cfa_offset 16
	.cfi_offset 6, -16
	movq	%rsi, %r10
	movq	%rdx, %rsi
	movq	%r8, %rdx
	vpxor	%xmm0, %xmm0, %xmm0
	movq	%rdi, %rax
	movq	%rsp, %rbp
	.cfi_def_cfa_register 6
	pushq	%r12
	pushq	%rbx
	.cfi_offset 12, -24
	.cfi_offset 3, -32
	movzbl	%r8b, %ebx
	movb	%dl, %bh
	andq	$-64, %rsp
	subq	$2112, %rsp
	movq	.LC0(%rip), %rdx
	movq	16(%rbp), %r12
	movq	%fs:40, %rdi
	movq	%rdi, 2104(%rsp)
	xorl	%edi, %edi
	vmovdqa64	%zmm0, (%rsp)
	movl	$4112, %edi
	movq	%rdx, 16(%rsp)
	movl	$64, %edx
	movb	$1, (%rsp)
	movw	%bx, 48(%rsp)
	movb	%r8b, 50(%rsp)
	movw	%dx, 24(%rsp)
	movw	%di, 51(%rsp)
	movq	%rsp, %r11
	ldtilecfg	(%r11)
#APP
# 531 "cuda/src/host_mlp.cpp" 1
	tilezero	%tmm0
# 0 "" 2
# 532 "cuda/src/host_mlp.cpp" 1
	tilezero	%tmm1
# 0 "" 2
#NO_APP
	testq	%r9, %r9
	jle	.L21
	leaq	0(,%rcx,4), %r8
	movl	$-127, %ecx
	vmovdqa64	.LC4(%rip), %zmm8
	vmovdqa64	.LC5(%rip), %zmm7
	vpbroadcastw	%ecx, %zmm6
	movl	$983055, %ecx
	xorl	%edx, %edx
	vmovdqa64	.LC7(%rip), %zmm1
	vpbroadcastd	%ecx, %zmm4
	movl	$7, %ecx
	leaq	64(%rsp), %rbx
	movl	$128, %edi
	vpbroadcastw	%ecx, %zmm0
	.p2align 4,,10
	.p2align 3
.L20:
	vpmovzxbw	(%rax), %zmm5
	movq	%rdx, %rcx
	sarq	$4, %rcx
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	salq	$5, %rcx
	vptestmw	%zmm0, %zmm5, %k1
	vpmovzxbw	(%r10,%rcx), %zmm2
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm6, %zmm2, %zmm2
	vpsllw	$7, %zmm2, %zmm2
	vpermw	%zmm2, %zmm8, %zmm3
	vpermw	%zmm2, %zmm7, %zmm2
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, (%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 64(%rsp)
	vpmovzxbw	32(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 128(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 192(%rsp)
	vpmovzxbw	64(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 256(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 320(%rsp)
	vpmovzxbw	96(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 384(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 448(%rsp)
	vpmovzxbw	128(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 512(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 576(%rsp)
	vpmovzxbw	160(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 640(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 704(%rsp)
	vpmovzxbw	192(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm11{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm11, 768(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 832(%rsp)
	vpmovzxbw	224(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 896(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 960(%rsp)
	vpmovzxbw	256(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm11{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm11, 1024(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1088(%rsp)
	vpmovzxbw	288(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 1152(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1216(%rsp)
	vpmovzxbw	320(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm11{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm11, 1280(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1344(%rsp)
	vpmovzxbw	352(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 1408(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1472(%rsp)
	vpmovzxbw	384(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm11{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm11, 1536(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1600(%rsp)
	vpmovzxbw	416(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm12
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm12{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm12, 1664(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1728(%rsp)
	vpmovzxbw	448(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm9, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm11{%k1}
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm11, 1792(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm5{%k1}
	vmovdqa64	%zmm5, 1856(%rsp)
	vpmovzxbw	480(%rax), %zmm5
	vpsrlw	$4, %zmm5, %zmm10
	vpandd	%zmm4, %zmm5, %zmm5
	vptestmw	%zmm0, %zmm5, %k1
	vpermw	%zmm1, %zmm5, %zmm11
	vpermw	%zmm1, %zmm10, %zmm9
	vmovdqa64	%zmm11, %zmm5
	vpaddw	%zmm3, %zmm11, %zmm5{%k1}
	vmovdqa64	%zmm9, %zmm3
	vptestmw	%zmm0, %zmm10, %k1
	vmovdqa64	%zmm5, 1920(%rsp)
	vpaddw	%zmm2, %zmm9, %zmm3{%k1}
	vmovdqa64	%zmm3, 1984(%rsp)
#APP
# 538 "cuda/src/host_mlp.cpp" 1
	tileloadd	(%rsi,%r8,1), %tmm2
# 0 "" 2
# 539 "cuda/src/host_mlp.cpp" 1
	tileloadd	(%r11,%rdi,1), %tmm3
# 0 "" 2
# 540 "cuda/src/host_mlp.cpp" 1
	tileloadd	(%rbx,%rdi,1), %tmm4
# 0 "" 2
# 541 "cuda/src/host_mlp.cpp" 1
	tdpbf16ps	%tmm3, %tmm2, %tmm0
# 0 "" 2
# 542 "cuda/src/host_mlp.cpp" 1
	tdpbf16ps	%tmm4, %tmm2, %tmm1
# 0 "" 2
#NO_APP
	addq	$16, %rdx
	addq	$512, %rax
	addq	$64, %rsi
	cmpq	%rdx, %r9
	jg	.L20
.L21:
	movl	$128, %eax
#APP
# 546 "cuda/src/host_mlp.cpp" 1
	tilestored	%tmm0, (%r12,%rax,1)
# 0 "" 2
#NO_APP
	addq	$64, %r12
#APP
# 547 "cuda/src/host_mlp.cpp" 1
	tilestored	%tmm1, (%r12,%rax,1)
# 0 "" 2
#NO_APP
	movq	2104(%rsp), %rax
	subq	%fs:40, %rax
	jne	.L28
	vzeroupper
	leaq	-16(%rbp), %rsp
	popq	%rbx
	popq	%r12
	popq	%rbp
	.cfi_remember_state
	.cfi_def_cfa 7, 8
	ret
.L28:
	.cfi_restore_state
	vzeroupper
	call	__stack_chk_fail@PLT
	.cfi_endproc
.LFE10772:
	.size	_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_15Mxfp4AvxDecoderEEEvPKhS4_PKtlllPf, .-_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_15Mxfp4AvxDecoderEEEvPKhS4_PKtlllPf
_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_13Fp8AvxDecoderEEEvPKhS4_PKtlllPf.isra.0:
.LFB11824:
	.cfi_startproc
	pushq	%rbp
	.cfi_def_cfa_offset 16
	.cfi_offset 6, -16
	vpxor	%xmm0, %xmm0, %xmm0
	movl	$64, %eax
	movq	%rsp, %rbp
	.cfi_def_cfa_register 6
	pushq	%r13
	pushq	%r12
	.cfi_offset 13, -24
	.cfi_offset 12, -32
	movq	%r9, %r12
	pushq	%rbx
	.cfi_offset 3, -40
	movq	%rdx, %rbx
	andq	$-64, %rsp
	subq	$2112, %rsp
	movq	%fs:40, %rdx
	movq	%rdx, 2104(%rsp)
	xorl	%edx, %edx
	movzbl	%cl, %edx
	vmovdqa64	%zmm0, (%rsp)
	movb	%cl, %dh
	movb	$1, (%rsp)
	movw	%dx, 48(%rsp)
	movq	.LC0(%rip), %rdx
	movb	%cl, 50(%rsp)
	movq	%rdx, 16(%rsp)
	movl	$4112, %edx
	movw	%ax, 24(%rsp)
	movw	%dx, 51(%rsp)
	movq	%rsp, %r13
	ldtilecfg	0(%r13)
#APP
# 531 "cuda/src/host_mlp.cpp" 1
	tilezero	%tmm0
# 0 "" 2
# 532 "cuda/src/host_mlp.cpp" 1
	tilezero	%tmm1
# 0 "" 2
#NO_APP
	salq	$2, %rbx
	testq	%r8, %r8
	jle	.L224
	movq	%rdi, %rax
	movq	%rsi, %rdi
	vmovdqa64	.LC10(%rip), %zmm8
	vmovdqa64	.LC11(%rip), %zmm7
	leaq	32(%rax), %rsi
	movl	$64, %eax
	leaq	64(%rsp), %r9
	xorl	%r10d, %r10d
	vpbroadcastw	%eax, %zmm4
	movl	$-2147450880, %eax
	vmovdqa64	.LC12(%rip), %zmm6
	vmovdqa64	.LC13(%rip), %zmm5
	leaq	2112(%rsp), %rcx
	vpbroadcastd	%eax, %zmm3
	movl	$128, %r11d
	.p2align 4,,10
	.p2align 3
.L225:
	movq	%r9, %rax
	movq	%rsi, %rdx
	.p2align 4,,10
	.p2align 3
.L226:
	vpmovzxbw	-32(%rdx), %zmm0
	vmovdqa64	%zmm8, %zmm2
	vmovdqa64	%zmm6, %zmm1
	vmovdqa64	%zmm6, %zmm9
	subq	$-128, %rax
	addq	$64, %rdx
	vptestmw	%zmm4, %zmm0, %k1
	vpermt2w	%zmm5, %zmm0, %zmm1
	vpermt2w	%zmm7, %zmm0, %zmm2
	vpsllw	$8, %zmm0, %zmm0
	vmovdqu16	%zmm1, %zmm2{%k1}
	vmovdqa64	%zmm8, %zmm1
	vpternlogd	$248, %zmm3, %zmm0, %zmm2
	vpmovzxbw	-64(%rdx), %zmm0
	vmovdqa32	%zmm2, -192(%rax)
	vptestmw	%zmm4, %zmm0, %k1
	vpermt2w	%zmm7, %zmm0, %zmm1
	vpermt2w	%zmm5, %zmm0, %zmm9
	vpsllw	$8, %zmm0, %zmm0
	vmovdqu16	%zmm9, %zmm1{%k1}
	vpternlogd	$248, %zmm3, %zmm0, %zmm1
	vmovdqa32	%zmm1, -128(%rax)
	cmpq	%rax, %rcx
	jne	.L226
#APP
# 538 "cuda/src/host_mlp.cpp" 1
	tileloadd	(%rdi,%rbx,1), %tmm2
# 0 "" 2
# 539 "cuda/src/host_mlp.cpp" 1
	tileloadd	(%r13,%r11,1), %tmm3
# 0 "" 2
# 540 "cuda/src/host_mlp.cpp" 1
	tileloadd	(%r9,%r11,1), %tmm4
# 0 "" 2
# 541 "cuda/src/host_mlp.cpp" 1
	tdpbf16ps	%tmm3, %tmm2, %tmm0
# 0 "" 2
# 542 "cuda/src/host_mlp.cpp" 1
	tdpbf16ps	%tmm4, %tmm2, %tmm1
# 0 "" 2
#NO_APP
	addq	$16, %r10
	addq	$64, %rdi
	addq	$1024, %rsi
	cmpq	%r8, %r10
	jl	.L225
.L224:
	movl	$128, %eax
#APP
# 546 "cuda/src/host_mlp.cpp" 1
	tilestored	%tmm0, (%r12,%rax,1)
# 0 "" 2
#NO_APP
	addq	$64, %r12
#APP
# 547 "cuda/src/host_mlp.cpp" 1
	tilestored	%tmm1, (%r12,%rax,1)
# 0 "" 2
#NO_APP
	movq	2104(%rsp), %rax
	subq	%fs:40, %rax
	jne	.L231
	vzeroupper
	leaq	-24(%rbp), %rsp
	popq	%rbx
	popq	%r12
	popq	%r13
	popq	%rbp
	.cfi_remember_state
	.cfi_def_cfa 7, 8
	ret
.L231:
	.cfi_restore_state
	vzeroupper
	call	__stack_chk_fail@PLT
	.cfi_endproc
.LFE11824:
	.size	_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_13Fp8AvxDecoderEEEvPKhS4_PKtlllPf.isra.0, .-_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_13Fp8AvxDecoderEEEvPKhS4_PKtlllPf.isra.0
