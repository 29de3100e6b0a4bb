set terminal pngcairo size 900,700 font ",10"
set output "peers_256x2304x262144_time.png"
set title "fusedhead and peers: N=256 H=2304 V=262144, 2 threads (time; gaps: peer not run)" noenhanced
set style fill solid 0.8 border -1
set boxwidth 0.7
set xtics rotate by -60 noenhanced
set bmargin 14
set rmargin 12
set ylabel "ms per train step (log scale)"
set grid ytics
set logscale y
set datafile missing "nan"
set key off
plot "peers_256x2304x262144.dat" using 0:2:($4 > 0 ? 0xd62728 : 0x1f77b4):xtic(1) with boxes lc rgb variable
