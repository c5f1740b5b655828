"""A small multilingual text corpus for the test tokenizer (our own sentences, no external data).

Seven languages, with the accents and special letters each uses, so the BPE learns a mix of
whole-word pieces, sub-word pieces and single characters, and byte fallback still has work to do
for characters outside it (e.g. emoji, CJK).
"""

CORPUS = {
    "en": """\
The quick brown fox jumps over the lazy dog near the river bank.
She sells sea shells by the sea shore every summer morning.
We measured the encoder output against the quantised reference on seven clips.
The weather today is cold and windy, but tomorrow it should be warm and sunny.
Please open the window, the room is getting far too hot for anyone to work in.
He walked to the station, bought a ticket and waited for the train to London.
Numbers like one, two, three, twenty and a hundred appear in many transcripts.
It is a truth universally acknowledged that a good test finds the bug first.
The children played in the garden while their parents talked about the harvest.
Speech recognition turns spoken words into text, one small piece at a time.
Could you tell me where the nearest library is, and when it opens on Sunday?
The meeting starts at nine o'clock, so do not be late again this week.
Music, painting and poetry were the things she loved most in the world.
After the storm the streets were quiet, wet and covered with fallen leaves.
""",
    "de": """\
Der schnelle braune Fuchs springt über den faulen Hund am Flussufer.
Die Straßenbahn fährt heute später, weil es auf der Brücke einen Unfall gab.
Ich möchte gern ein Glas Wasser und ein Stück Käsekuchen, bitte.
Wir haben die Ausgabe des Encoders mit der quantisierten Referenz verglichen.
Im Frühling blühen die Bäume, und die Vögel singen schon früh am Morgen.
Können Sie mir sagen, wo der Bahnhof ist und wann der nächste Zug fährt?
Die Größe der Wohnung ist für eine Familie mit drei Kindern zu klein.
Übermorgen treffen wir uns in München, um über das neue Projekt zu sprechen.
Es regnet seit Tagen, und die Straßen sind nass und voller Blätter.
Spracherkennung wandelt gesprochene Wörter in geschriebenen Text um.
""",
    "fr": """\
Le renard brun et rapide saute par-dessus le chien paresseux près de la rivière.
Nous avons comparé la sortie de l'encodeur avec la référence quantifiée.
Où est la gare, s'il vous plaît ? Je dois prendre le train de neuf heures.
Il fait très beau aujourd'hui, mais demain il va pleuvoir à Paris.
Les élèves ont étudié l'histoire de France pendant toute l'année scolaire.
J'ai acheté du pain, du fromage et une bouteille de vin pour le dîner.
La reconnaissance vocale transforme les mots prononcés en texte écrit.
Ça fait plaisir de vous revoir après ces longues vacances d'été.
Le cœur a ses raisons que la raison ne connaît point, disait le philosophe.
Après l'orage, les rues étaient calmes, mouillées et couvertes de feuilles.
""",
    "es": """\
El rápido zorro marrón salta sobre el perro perezoso junto al río.
¿Dónde está la estación de tren? Necesito llegar a Madrid mañana.
Los niños jugaban en el jardín mientras sus padres hablaban de la cosecha.
El reconocimiento de voz convierte las palabras habladas en texto.
Me gustaría un café con leche y un trozo de pastel, por favor.
""",
    "it": """\
La volpe marrone veloce salta sopra il cane pigro vicino al fiume.
Dov'è la stazione? Devo prendere il treno per Roma alle nove.
Oggi fa bel tempo, ma domani pioverà su tutta la città.
Il riconoscimento vocale trasforma le parole pronunciate in testo scritto.
Perché non vieni a cena da noi venerdì sera? Sarà una bella serata.
""",
    "nl": """\
De snelle bruine vos springt over de luie hond bij de rivier.
Waar is het station? Ik moet morgen vroeg naar Amsterdam.
Het regent al dagen en de straten zijn nat en vol bladeren.
Spraakherkenning zet gesproken woorden om in geschreven tekst.
Wij hebben de uitvoer van de encoder vergeleken met de referentie.
""",
    "pl": """\
Szybki brązowy lis przeskakuje nad leniwym psem przy rzece.
Gdzie jest dworzec? Muszę jutro rano pojechać pociągiem do Krakowa.
Żółw powoli szedł przez łąkę, a źrebię biegało wokół stodoły.
Porównaliśmy wyjście kodera z kwantyzowaną referencją na siedmiu nagraniach.
Dziś jest zimno i wietrznie, ale jutro ma być ciepło i słonecznie.
Rozpoznawanie mowy zamienia wypowiedziane słowa na tekst pisany.
Chrząszcz brzmi w trzcinie w Szczebrzeszynie, mówi znane zdanie.
Proszę otworzyć okno, w pokoju jest za gorąco, żeby pracować.
""",
}

