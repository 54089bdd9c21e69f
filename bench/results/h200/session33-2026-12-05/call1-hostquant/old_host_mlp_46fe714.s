_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_15Mxfp4AvxDecoderEEEvPKhS4_PKtlllPf:
.LFB10770:
	.cfi_startproc
	pushq	%rbp
	.cfi_def_cfa_offset 16
	.cfi_offset 6, -16
	movq	%rdx, %rax
	movq	%rcx, %rdx
	movq	%r8, %rcx
	vpxor	%xmm0, %xmm0, %xmm0
	movq	%rsp, %rbp
	.cfi_def_cfa_register 6
	pushq	%rbx
	.cfi_offset 3, -24
	movzbl	%cl, %ebx
	movb	%cl, %bh
	andq	$-64, %rsp
	subq	$2368, %rsp
	movq	16(%rbp), %r11
	movq	%fs:40, %r8
	movq	%r8, 2360(%rsp)
	xorl	%r8d, %r8d
	leaq	256(%rsp), %r10
	movl	$4112, %r8d
	vmovdqa64	%zmm0, 256(%rsp)
	movb	%cl, 306(%rsp)
	movq	.LC0(%rip), %rcx
	movb	$1, 256(%rsp)
	movq	%rcx, 272(%rsp)
	movl	$64, %ecx
	movw	%bx, 304(%rsp)
	movw	%cx, 280(%rsp)
	movw	%r8w, 307(%rsp)
	ldtilecfg	(%r10)
#APP
# 518 "old_host_mlp_46fe714.cpp" 1
	tilezero	%tmm0
# 0 "" 2
# 519 "old_host_mlp_46fe714.cpp" 1
	tilezero	%tmm1
# 0 "" 2
#NO_APP
	testq	%r9, %r9
	jle	.L19
	leaq	0(,%rdx,4), %r8
	leaq	320(%rsp), %rbx
	xorl	%edx, %edx
	movl	$128, %ecx
	.p2align 4,,10
	.p2align 3
.L20:
#APP
# 525 "old_host_mlp_46fe714.cpp" 1
	tileloadd	(%rax,%r8,1), %tmm2
# 0 "" 2
# 526 "old_host_mlp_46fe714.cpp" 1
	tileloadd	(%r10,%rcx,1), %tmm3
# 0 "" 2
# 527 "old_host_mlp_46fe714.cpp" 1
	tileloadd	(%rbx,%rcx,1), %tmm4
# 0 "" 2
# 528 "old_host_mlp_46fe714.cpp" 1
	tdpbf16ps	%tmm3, %tmm2, %tmm0
# 0 "" 2
# 529 "old_host_mlp_46fe714.cpp" 1
	tdpbf16ps	%tmm4, %tmm2, %tmm1
# 0 "" 2
#NO_APP
	addq	$16, %rdx
	addq	$64, %rax
	cmpq	%rdx, %r9
	jg	.L20
	subq	$1, %r9
	movl	$-127, %ecx
	vmovdqa64	.LC4(%rip), %zmm3
	movq	%r9, %rdx
	andq	$-16, %r9
	vpbroadcastw	%ecx, %zmm0
	vpmovzxbw	(%rsi,%r9,2), %zmm2
	leaq	1(%r9), %rax
	shrq	$4, %rdx
	salq	$5, %rax
	salq	$9, %rdx
	vpaddw	%zmm0, %zmm2, %zmm2
	vpmovzxbw	(%rdi,%rdx), %zmm17
	vpmovzxbw	384(%rdi,%rax), %zmm1
	movl	$983055, %edx
	vpsllw	$7, %zmm2, %zmm2
	vpmovzxbw	(%rdi,%rax), %zmm16
	vmovdqa64	.LC5(%rip), %zmm0
	vpermw	%zmm2, %zmm3, %zmm3
	vpsrlw	$4, %zmm1, %zmm4
	vpmovzxbw	32(%rdi,%rax), %zmm15
	vpmovzxbw	64(%rdi,%rax), %zmm14
	vpermw	%zmm2, %zmm0, %zmm2
	vpbroadcastd	%edx, %zmm0
	vmovdqa64	%zmm4, 192(%rsp)
	vpmovzxbw	96(%rdi,%rax), %zmm13
	vpandd	%zmm0, %zmm1, %zmm4
	vpmovzxbw	416(%rdi,%rax), %zmm1
	vpmovzxbw	128(%rdi,%rax), %zmm12
	vpsrlw	$4, %zmm17, %zmm30
	vpmovzxbw	160(%rdi,%rax), %zmm11
	vpmovzxbw	192(%rdi,%rax), %zmm10
	vmovdqa32	%zmm4, 128(%rsp)
	vpandd	%zmm0, %zmm17, %zmm17
	vpmovzxbw	224(%rdi,%rax), %zmm9
	vpmovzxbw	256(%rdi,%rax), %zmm8
	vpsrlw	$4, %zmm1, %zmm31
	vpandd	%zmm0, %zmm1, %zmm1
	vpmovzxbw	288(%rdi,%rax), %zmm7
	vpmovzxbw	320(%rdi,%rax), %zmm6
	vmovdqa32	%zmm1, (%rsp)
	vpsrlw	$4, %zmm16, %zmm29
	vpsrlw	$4, %zmm15, %zmm28
	vpandd	%zmm0, %zmm16, %zmm16
	vpmovzxbw	352(%rdi,%rax), %zmm5
	vpmovzxbw	448(%rdi,%rax), %zmm4
	movl	$7, %eax
	vpandd	%zmm0, %zmm15, %zmm15
	vmovdqa64	%zmm31, 64(%rsp)
	vpbroadcastw	%eax, %zmm1
	vpsrlw	$4, %zmm14, %zmm27
	vpandd	%zmm0, %zmm14, %zmm14
	vptestmw	%zmm1, %zmm17, %k1
	vpsrlw	$4, %zmm13, %zmm26
	vpsrlw	$4, %zmm12, %zmm25
	vpandd	%zmm0, %zmm13, %zmm13
	vpandd	%zmm0, %zmm12, %zmm12
	vpsrlw	$4, %zmm11, %zmm24
	vpandd	%zmm0, %zmm11, %zmm11
	vpsrlw	$4, %zmm10, %zmm23
	vpsrlw	$4, %zmm9, %zmm22
	vpandd	%zmm0, %zmm10, %zmm10
	vpandd	%zmm0, %zmm9, %zmm9
	vpsrlw	$4, %zmm8, %zmm21
	vpandd	%zmm0, %zmm8, %zmm8
	vpsrlw	$4, %zmm7, %zmm20
	vpsrlw	$4, %zmm6, %zmm19
	vpandd	%zmm0, %zmm7, %zmm7
	vpandd	%zmm0, %zmm6, %zmm6
	vpsrlw	$4, %zmm5, %zmm18
	vpandd	%zmm0, %zmm5, %zmm5
	vpsrlw	$4, %zmm4, %zmm31
	vpandd	%zmm0, %zmm4, %zmm4
	vmovdqa64	.LC8(%rip), %zmm0
	vpermw	%zmm0, %zmm17, %zmm17
	vpaddw	%zmm3, %zmm17, %zmm17{%k1}
	vptestmw	%zmm1, %zmm30, %k1
	vpermw	%zmm0, %zmm30, %zmm30
	vmovdqa64	%zmm17, 256(%rsp)
	vpaddw	%zmm2, %zmm30, %zmm30{%k1}
	vptestmw	%zmm1, %zmm16, %k1
	vpermw	%zmm0, %zmm16, %zmm16
	vmovdqa64	%zmm30, 320(%rsp)
	vpaddw	%zmm3, %zmm16, %zmm16{%k1}
	vptestmw	%zmm1, %zmm29, %k1
	vpermw	%zmm0, %zmm29, %zmm29
	vmovdqa64	%zmm16, 384(%rsp)
	vpaddw	%zmm2, %zmm29, %zmm29{%k1}
	vptestmw	%zmm1, %zmm15, %k1
	vpermw	%zmm0, %zmm15, %zmm15
	vmovdqa64	%zmm29, 448(%rsp)
	vpaddw	%zmm3, %zmm15, %zmm15{%k1}
	vptestmw	%zmm1, %zmm28, %k1
	vpermw	%zmm0, %zmm28, %zmm28
	vmovdqa64	%zmm15, 512(%rsp)
	vmovdqa64	%zmm28, %zmm15
	vpaddw	%zmm2, %zmm28, %zmm15{%k1}
	vptestmw	%zmm1, %zmm14, %k1
	vpermw	%zmm0, %zmm14, %zmm14
	vmovdqa64	%zmm15, 576(%rsp)
	vpaddw	%zmm3, %zmm14, %zmm14{%k1}
	vptestmw	%zmm1, %zmm27, %k1
	vpermw	%zmm0, %zmm27, %zmm27
	vmovdqa64	%zmm14, 640(%rsp)
	vmovdqa64	%zmm27, %zmm14
	vpaddw	%zmm2, %zmm27, %zmm14{%k1}
	vptestmw	%zmm1, %zmm13, %k1
	vpermw	%zmm0, %zmm13, %zmm13
	vmovdqa64	%zmm14, 704(%rsp)
	vpaddw	%zmm3, %zmm13, %zmm13{%k1}
	vptestmw	%zmm1, %zmm26, %k1
	vpermw	%zmm0, %zmm26, %zmm26
	vmovdqa64	%zmm13, 768(%rsp)
	vmovdqa64	%zmm26, %zmm13
	vpaddw	%zmm2, %zmm26, %zmm13{%k1}
	vptestmw	%zmm1, %zmm12, %k1
	vpermw	%zmm0, %zmm12, %zmm12
	vmovdqa64	%zmm13, 832(%rsp)
	vpaddw	%zmm3, %zmm12, %zmm12{%k1}
	vptestmw	%zmm1, %zmm25, %k1
	vpermw	%zmm0, %zmm25, %zmm25
	vmovdqa64	%zmm12, 896(%rsp)
	vmovdqa64	%zmm25, %zmm12
	vpaddw	%zmm2, %zmm25, %zmm12{%k1}
	vptestmw	%zmm1, %zmm11, %k1
	vpermw	%zmm0, %zmm11, %zmm11
	vmovdqa64	%zmm12, 960(%rsp)
	vpaddw	%zmm3, %zmm11, %zmm11{%k1}
	vptestmw	%zmm1, %zmm24, %k1
	vpermw	%zmm0, %zmm24, %zmm24
	vmovdqa64	%zmm11, 1024(%rsp)
	vmovdqa64	%zmm24, %zmm11
	vpaddw	%zmm2, %zmm24, %zmm11{%k1}
	vptestmw	%zmm1, %zmm10, %k1
	vpermw	%zmm0, %zmm10, %zmm10
	vmovdqa64	%zmm11, 1088(%rsp)
	vpaddw	%zmm3, %zmm10, %zmm10{%k1}
	vptestmw	%zmm1, %zmm23, %k1
	vpermw	%zmm0, %zmm23, %zmm23
	vmovdqa64	%zmm10, 1152(%rsp)
	vmovdqa64	%zmm23, %zmm10
	vpaddw	%zmm2, %zmm23, %zmm10{%k1}
	vptestmw	%zmm1, %zmm9, %k1
	vpermw	%zmm0, %zmm9, %zmm9
	vmovdqa64	%zmm10, 1216(%rsp)
	vpaddw	%zmm3, %zmm9, %zmm9{%k1}
	vptestmw	%zmm1, %zmm22, %k1
	vpermw	%zmm0, %zmm22, %zmm22
	vmovdqa64	%zmm9, 1280(%rsp)
	vmovdqa64	%zmm22, %zmm9
	vpaddw	%zmm2, %zmm22, %zmm9{%k1}
	vptestmw	%zmm1, %zmm8, %k1
	vpermw	%zmm0, %zmm8, %zmm8
	vmovdqa64	%zmm9, 1344(%rsp)
	vpaddw	%zmm3, %zmm8, %zmm8{%k1}
	vptestmw	%zmm1, %zmm21, %k1
	vpermw	%zmm0, %zmm21, %zmm21
	vmovdqa64	%zmm8, 1408(%rsp)
	vmovdqa64	%zmm21, %zmm8
	vpaddw	%zmm2, %zmm21, %zmm8{%k1}
	vptestmw	%zmm1, %zmm7, %k1
	vpermw	%zmm0, %zmm7, %zmm7
	vmovdqa64	%zmm8, 1472(%rsp)
	vmovdqa64	%zmm7, %zmm8
	vpaddw	%zmm3, %zmm7, %zmm8{%k1}
	vmovdqa64	192(%rsp), %zmm7
	vptestmw	%zmm1, %zmm20, %k1
	vpermw	%zmm0, %zmm20, %zmm20
	vmovdqa64	%zmm8, 1536(%rsp)
	vpaddw	%zmm2, %zmm20, %zmm20{%k1}
	vptestmw	%zmm1, %zmm6, %k1
	vpermw	%zmm0, %zmm6, %zmm6
	vmovdqa64	%zmm20, 1600(%rsp)
	vpaddw	%zmm3, %zmm6, %zmm6{%k1}
	vptestmw	%zmm1, %zmm19, %k1
	vpermw	%zmm0, %zmm19, %zmm19
	vmovdqa64	%zmm6, 1664(%rsp)
	vmovdqa64	%zmm19, %zmm6
	vpaddw	%zmm2, %zmm19, %zmm6{%k1}
	vptestmw	%zmm1, %zmm5, %k1
	vpermw	%zmm0, %zmm5, %zmm5
	vmovdqa64	%zmm6, 1728(%rsp)
	vmovdqa32	128(%rsp), %zmm6
	vpaddw	%zmm3, %zmm5, %zmm5{%k1}
	vptestmw	%zmm1, %zmm18, %k1
	vpermw	%zmm0, %zmm18, %zmm18
	vmovdqa64	%zmm5, 1792(%rsp)
	vmovdqa64	%zmm18, %zmm5
	vpaddw	%zmm2, %zmm18, %zmm5{%k1}
	vptestmw	%zmm1, %zmm6, %k1
	vmovdqa64	%zmm5, 1856(%rsp)
	vpermw	%zmm0, %zmm6, %zmm5
	vmovdqa64	%zmm5, %zmm6
	vpaddw	%zmm3, %zmm5, %zmm6{%k1}
	vpermw	%zmm0, %zmm7, %zmm5
	vptestmw	%zmm1, %zmm7, %k1
	vmovdqa64	%zmm6, 1920(%rsp)
	vmovdqa64	%zmm5, %zmm6
	vmovdqa64	64(%rsp), %zmm7
	vpaddw	%zmm2, %zmm5, %zmm6{%k1}
	vmovdqa32	(%rsp), %zmm5
	vmovdqa64	%zmm6, 1984(%rsp)
	vptestmw	%zmm1, %zmm5, %k1
	vpermw	%zmm0, %zmm5, %zmm5
	vpaddw	%zmm3, %zmm5, %zmm5{%k1}
	vptestmw	%zmm1, %zmm7, %k1
	vmovdqa64	%zmm5, 2048(%rsp)
	vpermw	%zmm0, %zmm7, %zmm5
	vmovdqa64	%zmm5, %zmm6
	vpaddw	%zmm2, %zmm5, %zmm6{%k1}
	vptestmw	%zmm1, %zmm4, %k1
	vpermw	%zmm0, %zmm4, %zmm4
	vpermw	%zmm0, %zmm31, %zmm0
	vmovdqa64	%zmm6, 2112(%rsp)
	vpaddw	%zmm3, %zmm4, %zmm4{%k1}
	vptestmw	%zmm1, %zmm31, %k1
	vmovdqa64	%zmm0, %zmm1
	vmovdqa64	%zmm4, 2176(%rsp)
	vpaddw	%zmm2, %zmm0, %zmm1{%k1}
	vmovdqa64	%zmm1, 2240(%rsp)
.L19:
	movl	$128, %eax
#APP
# 533 "old_host_mlp_46fe714.cpp" 1
	tilestored	%tmm0, (%r11,%rax,1)
# 0 "" 2
#NO_APP
	addq	$64, %r11
#APP
# 534 "old_host_mlp_46fe714.cpp" 1
	tilestored	%tmm1, (%r11,%rax,1)
# 0 "" 2
#NO_APP
	movq	2360(%rsp), %rax
	subq	%fs:40, %rax
	jne	.L26
	vzeroupper
	movq	-8(%rbp), %rbx
	leave
	.cfi_remember_state
	.cfi_def_cfa 7, 8
	ret
.L26:
	.cfi_restore_state
	vzeroupper
	call	__stack_chk_fail@PLT
	.cfi_endproc
.LFE10770:
	.size	_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_15Mxfp4AvxDecoderEEEvPKhS4_PKtlllPf, .-_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_15Mxfp4AvxDecoderEEEvPKhS4_PKtlllPf
_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_13Fp8AvxDecoderEEEvPKhS4_PKtlllPf.isra.0:
.LFB11822:
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
	movq	%rsp, %r13
	movb	%cl, %dh
	movb	$1, (%rsp)
	movw	%dx, 48(%rsp)
	movq	.LC0(%rip), %rdx
	movb	%cl, 50(%rsp)
	movq	%rdx, 16(%rsp)
	movl	$4112, %edx
	movw	%ax, 24(%rsp)
	movw	%dx, 51(%rsp)
	ldtilecfg	0(%r13)
#APP
# 518 "old_host_mlp_46fe714.cpp" 1
	tilezero	%tmm0
# 0 "" 2
# 519 "old_host_mlp_46fe714.cpp" 1
	tilezero	%tmm1
# 0 "" 2
#NO_APP
	salq	$2, %rbx
	testq	%r8, %r8
	jle	.L239
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
.L240:
	movq	%r9, %rax
	movq	%rsi, %rdx
	.p2align 4,,10
	.p2align 3
.L241:
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
	jne	.L241
#APP
# 525 "old_host_mlp_46fe714.cpp" 1
	tileloadd	(%rdi,%rbx,1), %tmm2
# 0 "" 2
# 526 "old_host_mlp_46fe714.cpp" 1
	tileloadd	(%r13,%r11,1), %tmm3
# 0 "" 2
# 527 "old_host_mlp_46fe714.cpp" 1
	tileloadd	(%r9,%r11,1), %tmm4
# 0 "" 2
# 528 "old_host_mlp_46fe714.cpp" 1
	tdpbf16ps	%tmm3, %tmm2, %tmm0
# 0 "" 2
# 529 "old_host_mlp_46fe714.cpp" 1
	tdpbf16ps	%tmm4, %tmm2, %tmm1
# 0 "" 2
#NO_APP
	addq	$16, %r10
	addq	$64, %rdi
	addq	$1024, %rsi
	cmpq	%r8, %r10
	jl	.L240
.L239:
	movl	$128, %eax
#APP
# 533 "old_host_mlp_46fe714.cpp" 1
	tilestored	%tmm0, (%r12,%rax,1)
# 0 "" 2
#NO_APP
	addq	$64, %r12
#APP
# 534 "old_host_mlp_46fe714.cpp" 1
	tilestored	%tmm1, (%r12,%rax,1)
# 0 "" 2
#NO_APP
	movq	2104(%rsp), %rax
	subq	%fs:40, %rax
	jne	.L246
	vzeroupper
	leaq	-24(%rbp), %rsp
	popq	%rbx
	popq	%r12
	popq	%r13
	popq	%rbp
	.cfi_remember_state
	.cfi_def_cfa 7, 8
	ret
.L246:
	.cfi_restore_state
	vzeroupper
	call	__stack_chk_fail@PLT
	.cfi_endproc
.LFE11822:
	.size	_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_13Fp8AvxDecoderEEEvPKhS4_PKtlllPf.isra.0, .-_ZN7pdflash12_GLOBAL__N_19dot_amx_qINS0_13Fp8AvxDecoderEEEvPKhS4_PKtlllPf.isra.0
